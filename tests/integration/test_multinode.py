"""Two "nodes" on one machine: two `rayless train` processes started as srun starts them (SLURM_NODEID 0 and 1,
SLURM_JOB_NODELIST=localhost), one gloo rank and one CPU engine each.

Node 0 runs the coordinator; node 1 runs only its torchrun agent and its engine, connected back to node 0.
Shown here: both ranks train in one world (the gradient all-reduce spans the nodes: every step's grad norm is
the same on both ranks while their samples differ), both engines serve and load every weight version, both
processes exit 0 and leave no process behind; a node 1 with the wrong token is refused and named in node 0's
log; killing node 1's whole process tree mid-run ends the run naming node 1 without train FT, and with train
(and rollout) FT the run recovers once the same command runs on node 1 again.

Each run costs two engines, two torchruns and two ranks, so each shows as much as it can: the clean run uses
the distributed transfer; the FT run is the disk run too (its impostor, its engines loading every snapshot from
the shared run directory, the one world of ranks, before and after the recovery).
"""

from __future__ import annotations

import json
import random
import socket
from pathlib import Path

import pytest

from tests.support.nodes import GATE_ENV, LOOK_EVERY_S, NodeProcess, look_at, wait_for
from tests.support.waiting import wait_until_sync

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TOKEN = "a-test-token-for-two-nodes-0123456789"


def free_port_run(count: int = 3) -> int:
    """A port P with P..P+count-1 free (the rendezvous, the control channel, the node registry)."""
    for _ in range(200):
        base = random.randint(20000, 45000)
        try:
            sockets = []
            for offset in range(count):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", base + offset))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError("no run of free ports")


def node_args(model: Path, run_dir: Path, *flags: str, rollouts: int = 2, engines: int = 2) -> list[str]:
    """Two rollouts show every update reaching every engine (and, killed in the second, a recovery); with
    `engines` 1 node 1 holds only its rank."""
    return [
        "--hf-checkpoint", str(model), "--engine-backend", "cpu", "--rollout-num-engines", str(engines),
        "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "1", "--prompt-data", "builtin:first_digit",
        "--num-rollout", str(rollouts), "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "4", "--sglang-server-concurrency", "8", "--run-dir", str(run_dir),
        "--no-progress", "--custom-rm-path", "tests.support.nodes:gated_reward", *flags,
    ]


def engine_loads(run_dir: Path, name: str) -> list[tuple[str, str]]:
    """What an engine's log says it loaded, in order: (the snapshot, in the run directory's weights/, the
    weight version)."""
    loads = []
    for line in (run_dir / "logs" / f"engine-{name}.log").read_text().splitlines():
        if " loaded " in line and "weight_version" in line:
            where, version = line.rsplit(" from ", 1)[1].rsplit(" (weight_version ", 1)
            assert Path(where).parent.resolve() == (run_dir / "weights").resolve(), line
            loads.append((Path(where).name, version.rstrip(")")))
    return loads


def assert_no_survivors(*nodes: NodeProcess) -> None:
    wait_until_sync(lambda: [line for node in nodes for line in node.survivors()], until=lambda left: not left,
                    timeout=10, interval=0.2, what="no process of the nodes left behind")


def assert_one_world(run_dir: Path, *nodes: NodeProcess) -> list[dict]:
    """Two steps trained by one world of two ranks, one per node, and the token in no log; the metrics rows."""
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rollouts"] == 2 and summary["train_steps"] == 2 and summary["final_weight_version"] == "2"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "train/grad_norm" in row]
    assert len(steps) == 2
    # each rank trained its own samples, and the gradients were all-reduced across the nodes before clipping,
    # so both ranks report the same (non-zero) grad norm
    assert all(row["train/grad_norm"] > 0 and row["train/grad_norm_rank_spread"] == 0.0 for row in steps)
    for node, log in ((0, "train_ranks-node0.log"), (1, "train_ranks-node1.log")):
        assert "--nnodes 2" in (run_dir / log).read_text(), f"node {node}'s torchrun joined the two-node world"
    coordinator_log = (run_dir / "coordinator.log").read_text()
    assert "node 1: engine rollout-1 answers at http://127.0.0.1:" in coordinator_log
    logs = [coordinator_log, (run_dir / "node1.log").read_text(), *(node.output() for node in nodes)]
    assert all(TOKEN not in text for text in logs)
    return rows


def test_two_nodes_train_in_one_world_and_both_engines_take_every_update(tiny_model_dir: Path,
                                                                          tmp_path: Path) -> None:
    """The clean run, with the distributed transfer (the disk transfer: the FT run below)."""
    run_dir, port = tmp_path / "run", free_port_run()
    args = node_args(tiny_model_dir, run_dir, "--update-weight-transfer-mode", "distributed")
    node0 = NodeProcess(0, args, master_port=port, token=TOKEN, log=tmp_path / "node0.out")
    node1 = NodeProcess(1, args, master_port=port, token=TOKEN, log=tmp_path / "node1.out")
    try:
        assert node0.wait(300, others=(node1,)) == 0, node0.output()[-4000:]
        assert node1.wait(60) == 0, node1.output()[-4000:]
    finally:
        for node in (node0, node1):
            if node.proc.poll() is None:
                node.kill_tree()
    rows = assert_one_world(run_dir, node0, node1)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [event["event"] for event in summary["nodes"]["events"]] == ["joined"]
    # both engines served and took every update: WeightSync checks that every engine it updated reports the new
    # version (else the run fails), and it updated both each time
    assert [row["sync/engines"] for row in rows if "sync/engines" in row] == [2.0, 2.0]
    assert_no_survivors(node0, node1)


def start_and_kill_node1(tmp_path: Path, args: list[str], port: int, gate: Path, *, impostor: bool = False
                         ) -> tuple[NodeProcess, NodeProcess, NodeProcess | None]:
    """Node 0 and node 1 (beside them, with `impostor`, a node 1 with the wrong token, refused), then node 1's
    whole tree killed while rollout 1 is being scored."""
    node0 = NodeProcess(0, args, master_port=port, token=TOKEN, log=tmp_path / "node0.out",
                        env={GATE_ENV: str(gate)})
    bad = None
    if impostor:  # the registry checks the token first, whichever node 1 dials first
        bad = NodeProcess(1, args, master_port=port, token="not-the-token-at-all-0123", log=tmp_path / "bad.out")
    node1 = NodeProcess(1, args, master_port=port, token=TOKEN, log=tmp_path / "node1.out")
    try:
        if bad is not None:
            assert bad.wait(120, others=(node0, node1)) == 1
            assert "node 0 refused node 1: wrong token from node 1" in bad.output()
        wait_for(gate / "reached", 300, nodes=(node0, node1))  # rollout 0 trained; rollout 1 being scored
        node1.kill_tree()
        wait_for_log(tmp_path / "run" / "coordinator.log", "node 1 lost", 60, node0)
    except BaseException:
        for node in (node0, bad, node1):
            if node is not None and node.proc.poll() is None:
                node.kill_tree()
        raise
    return node0, node1, bad


def wait_for_log(path: Path, text: str, timeout: float, node: NodeProcess) -> None:
    def logged() -> bool:
        if path.exists() and text in path.read_text():
            return True
        look_at((node,), at_most_every=LOOK_EVERY_S)
        assert node.proc.poll() is None, node.output()[-4000:]
        return False

    wait_until_sync(logged, timeout=timeout, interval=0.2, what=f"{text!r} in {path}")


def test_without_train_ft_a_lost_node_ends_the_run_naming_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    gate.mkdir()
    args = node_args(tiny_model_dir, tmp_path / "run", engines=1)  # the lost node's rank ends the run
    node0, node1, _ = start_and_kill_node1(tmp_path, args, free_port_run(), gate)
    try:
        (gate / "go").write_text("")
        assert node0.wait(120) == 1
    finally:
        if node0.proc.poll() is None:
            node0.kill_tree()
    output = node0.output()
    failure = next(line for line in output.splitlines() if "run failed" in line)
    assert "node 1" in failure, failure
    assert "node 1 lost (host" in output
    assert_no_survivors(node0, node1)


def test_with_train_ft_the_run_recovers_when_node1_runs_again(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Also the disk run: the impostor refused, the one world before and after the recovery, and every snapshot
    loaded from the shared run directory by both engines."""
    gate = tmp_path / "gate"
    gate.mkdir()
    run_dir = tmp_path / "run"
    args = node_args(tiny_model_dir, run_dir, "--update-weight-transfer-mode", "disk", "--use-fault-tolerance",
                     "--ft-components", "train", "rollout", "--max-restarts", "3", "--save", str(tmp_path / "ckpt"),
                     "--save-interval", "1", "--rollout-health-check-interval", "2",
                     "--rollout-health-check-timeout", "10")
    port = free_port_run()
    node0, dead, impostor = start_and_kill_node1(tmp_path, args, port, gate, impostor=True)
    assert impostor is not None
    node1 = NodeProcess(1, args, master_port=port, token=TOKEN, log=tmp_path / "node1-again.out")
    try:
        (gate / "go").write_text("")
        assert node0.wait(400, others=(node1,)) == 0, node0.output()[-6000:]
        assert node1.wait(60) == 0, node1.output()[-4000:]
    finally:
        for node in (node0, node1):
            if node.proc.poll() is None:
                node.kill_tree()
    rows = assert_one_world(run_dir, node0, impostor, dead, node1)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["train_recoveries"] >= 1
    assert [event["event"] for event in summary["nodes"]["events"]] == ["joined", "lost", "back"]
    log = (run_dir / "coordinator.log").read_text()
    assert "ranks are back from checkpoint" in log
    assert "node registry refused a connection from 127.0.0.1" in log
    assert f"wrong token from node 1 (pid {impostor.proc.pid}" in log
    # both engines took update 1 before node 1 was killed (the sync checks each engine it updated)
    assert next(row["sync/engines"] for row in rows if "sync/engines" in row) == 2.0
    # each engine loaded rank 0's snapshot of every version from the shared run directory, in order. Node 1's
    # died with it after version 1, came back with its node and was given the current weights (again version 1,
    # or version 2 when it came back after that sync); node 0's loads each version once unless rollout FT
    # relaunched it under load, which reloads the current one. Either way: version 1 first, version 2 last.
    for engine in ("rollout-0", "rollout-1"):
        loads = engine_loads(run_dir, engine)
        assert loads[0] == ("weights-1", "1") and loads[-1] == ("weights-2", "2"), (engine, loads)
        assert all(snapshot == f"weights-{version}" for snapshot, version in loads), (engine, loads)
    assert_no_survivors(node0, impostor, dead, node1)
