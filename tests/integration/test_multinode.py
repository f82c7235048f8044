"""Two "nodes" on one machine: two `rayless train` processes started as srun starts them (SLURM_NODEID 0 and 1,
SLURM_JOB_NODELIST=localhost), one gloo rank and one CPU engine each.

Node 0 runs the coordinator; node 1 runs only its torchrun agent and its engine, connected back to node 0.
Shown here: both ranks train in one world (the gradient all-reduce spans the nodes: every step's grad norm is
the same on both ranks while their samples differ), both engines serve and load every weight version, both
processes exit 0 and leave no process behind; a node 1 with the wrong token is refused and named in node 0's
log; killing node 1's whole process tree mid-run ends the run naming node 1 without train FT, and with train
(and rollout) FT the run recovers once the same command runs on node 1 again.
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


def engine_versions(run_dir: Path, name: str) -> list[str]:
    """The weight versions an engine's log says it loaded, in order."""
    text = (run_dir / "logs" / f"engine-{name}.log").read_text()
    return [line.rsplit("weight_version ", 1)[1].rstrip(")") for line in text.splitlines()
            if "loaded" in line and "weight_version" in line]


def assert_no_survivors(*nodes: NodeProcess) -> None:
    wait_until_sync(lambda: [line for node in nodes for line in node.survivors()], until=lambda left: not left,
                    timeout=10, interval=0.2, what="no process of the nodes left behind")


# The refused impostor (the node registry's check, whatever the transfer mode) in the disk run only.
@pytest.mark.parametrize(("mode", "impostor_first"), [("disk", True), ("distributed", False)])
def test_two_nodes_train_in_one_world_and_both_engines_take_every_update(tiny_model_dir: Path, tmp_path: Path,
                                                                          mode: str, impostor_first: bool) -> None:
    run_dir, port = tmp_path / "run", free_port_run()
    args = node_args(tiny_model_dir, run_dir, "--update-weight-transfer-mode", mode)
    node0 = NodeProcess(0, args, master_port=port, token=TOKEN, log=tmp_path / "node0.out")
    impostor = node1 = None
    try:
        if impostor_first:
            impostor = NodeProcess(1, args, master_port=port, token="not-the-token-at-all-0123",
                                   log=tmp_path / "bad.out")
            assert impostor.wait(120) == 1
            assert "node 0 refused node 1: wrong token from node 1" in impostor.output()
        node1 = NodeProcess(1, args, master_port=port, token=TOKEN, log=tmp_path / "node1.out")
        assert node0.wait(300, others=(node1,)) == 0, node0.output()[-4000:]
        assert node1.wait(60) == 0, node1.output()[-4000:]
    finally:
        for node in (node0, impostor, node1):
            if node is not None and node.proc.poll() is None:
                node.kill_tree()
    coordinator_log = (run_dir / "coordinator.log").read_text()
    if impostor is not None:
        assert "node registry refused a connection from 127.0.0.1" in coordinator_log
        assert f"wrong token from node 1 (pid {impostor.proc.pid}" in coordinator_log
    assert TOKEN not in coordinator_log + node0.output() + node1.output() + (run_dir / "node1.log").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rollouts"] == 2 and summary["train_steps"] == 2 and summary["final_weight_version"] == "2"
    assert [event["event"] for event in summary["nodes"]["events"]] == ["joined"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "train/grad_norm" in row]
    assert len(steps) == 2
    # one world of two ranks, one per node: each rank trained its own samples, and the gradients were
    # all-reduced across the nodes before clipping, so both ranks report the same (non-zero) grad norm
    assert all(row["train/grad_norm"] > 0 and row["train/grad_norm_rank_spread"] == 0.0 for row in steps)
    for node, log in ((0, "train_ranks-node0.log"), (1, "train_ranks-node1.log")):
        assert "--nnodes 2" in (run_dir / log).read_text(), f"node {node}'s torchrun joined the two-node world"
    # both engines served and took every update: WeightSync checks that every engine it updated reports the new
    # version (else the run fails), and it updated both each time
    assert [row["sync/engines"] for row in rows if "sync/engines" in row] == [2.0, 2.0]
    if mode == "disk":  # each loaded rank 0's snapshot from the shared run directory
        assert engine_versions(run_dir, "rollout-0") == ["1", "2"]
        assert engine_versions(run_dir, "rollout-1") == ["1", "2"]
    assert "node 1: engine rollout-1 answers at http://127.0.0.1:" in coordinator_log
    assert_no_survivors(*(node for node in (node0, impostor, node1) if node is not None))


def start_and_kill_node1(tmp_path: Path, args: list[str], port: int, gate: Path) -> tuple[NodeProcess, NodeProcess]:
    node0 = NodeProcess(0, args, master_port=port, token=TOKEN, log=tmp_path / "node0.out",
                        env={GATE_ENV: str(gate)})
    node1 = NodeProcess(1, args, master_port=port, token=TOKEN, log=tmp_path / "node1.out")
    try:
        wait_for(gate / "reached", 300, nodes=(node0, node1))  # rollout 0 trained; rollout 1 being scored
        node1.kill_tree()
        wait_for_log(tmp_path / "run" / "coordinator.log", "node 1 lost", 60, node0)
    except BaseException:
        for node in (node0, node1):
            if node.proc.poll() is None:
                node.kill_tree()
        raise
    return node0, node1


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
    node0, node1 = start_and_kill_node1(tmp_path, args, free_port_run(), gate)
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
    gate = tmp_path / "gate"
    gate.mkdir()
    run_dir = tmp_path / "run"
    args = node_args(tiny_model_dir, run_dir, "--use-fault-tolerance", "--ft-components", "train", "rollout",
                     "--max-restarts", "3", "--save", str(tmp_path / "ckpt"), "--save-interval", "1",
                     "--rollout-health-check-interval", "2", "--rollout-health-check-timeout", "10")
    port = free_port_run()
    node0, dead = start_and_kill_node1(tmp_path, args, port, gate)
    node1 = NodeProcess(1, args, master_port=port, token=TOKEN, log=tmp_path / "node1-again.out")
    try:
        (gate / "go").write_text("")
        assert node0.wait(400, others=(node1,)) == 0, node0.output()[-6000:]
        assert node1.wait(60) == 0, node1.output()[-4000:]
    finally:
        for node in (node0, node1):
            if node.proc.poll() is None:
                node.kill_tree()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rollouts"] == 2 and summary["final_weight_version"] == "2"
    assert summary["train_recoveries"] >= 1
    assert [event["event"] for event in summary["nodes"]["events"]] == ["joined", "lost", "back"]
    log = (run_dir / "coordinator.log").read_text()
    assert "ranks are back from checkpoint" in log
    # node 1's engine died with it, came back with its node and was given the current weights: it reports
    # the last version like the engine on node 0
    assert engine_versions(run_dir, "rollout-0")[-1] == "2"
    assert engine_versions(run_dir, "rollout-1")[-1] == "2"
    assert_no_survivors(node0, dead, node1)
