"""Multi-node pieces without a second machine: SLURM hostlists, the node layout read from the launcher's
environment, the control token's sources, the node registry's wire contract and its handshake against hostile
peers, the split of engines over nodes, and the shared-directory markers."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import Any

import anyio
import msgpack
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

from coordinator.config import ConfigError, parse_config
from coordinator.engines.errors import EngineError
from coordinator.nodes import shared, wire
from coordinator.nodes.registry import NodeRegistry
from coordinator.plan.layout import expand_nodelist, is_loopback, resolve_layout
from coordinator.plan.nodes import engine_share
from coordinator.plan.token import ControlTokenError, TokenSource, create_or_read_token_file, token_source
from tests.support.waiting import wait_until
from workers import protocol

BASE = ["--hf-checkpoint", "/m", "--rollout-batch-size", "8", "--num-rollout", "2", "--prompt-data",
        "builtin:first_digit", "--rollout-num-engines", "4"]
TOKEN = "0123456789abcdef0123456789abcdef"


def config(*flags: str):
    return parse_config([*BASE, *flags])


def two_nodes(*flags: str):
    return config("--actor-num-nodes", "2", *flags)


# -- SLURM hostlists ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "hosts"), [
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("gpu5", ["gpu5"]),
    ("a1,b[2-3],c", ["a1", "b2", "b3", "c"]),
    ("tux[9-11]", ["tux9", "tux10", "tux11"]),
    ("n[008-010]", ["n008", "n009", "n010"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("rack-a[1,3]-ib", ["rack-a1-ib", "rack-a3-ib"]),
])
def test_slurm_hostlists_expand_as_slurm_writes_them(text: str, hosts: list[str]) -> None:
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize("text", ["node[1-", "node[a]", "node[3-1]", "node]1[", "a,,b", "n[1-2"])
def test_a_malformed_hostlist_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        expand_nodelist(text)


# -- the layout ----------------------------------------------------------------------------------------------
def test_a_single_node_run_never_reads_the_environment() -> None:
    single = config()
    resolved, layout, warnings = resolve_layout(single, {"SLURM_NODEID": "3", "SLURM_JOB_NODELIST": "x[1-9]"})
    assert resolved is single and layout is None and warnings == []


def test_under_srun_the_node_rank_node_0_and_the_ports_come_from_slurm() -> None:
    env = {"SLURM_NODEID": "1", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu[07-08]",
           "SLURM_STEP_NODELIST": "gpu[05-06]", "RAYLESS_CONTROL_TOKEN": TOKEN}
    resolved, layout, _ = resolve_layout(two_nodes(), env)
    assert layout is not None and layout.node_rank == 1 and not layout.is_coordinator
    assert layout.master_host == "gpu05"  # the step's first node is SLURM_NODEID 0
    assert (layout.rdzv_port, layout.control_port, layout.registry_port) == (29500, 29501, 29502)
    # node 0 is not this machine: the single-node default 127.0.0.1 would be unreachable, so node 0 binds all
    assert layout.control_bind == "0.0.0.0" and layout.control_address == "gpu05:29501"
    assert resolved.cluster.actor_node_rank == 1 and resolved.cluster.rdzv_endpoint == "gpu05:29500"
    assert resolved.cluster.control_host == "0.0.0.0" and resolved.cluster.control_port == 29501
    assert layout.token.kind == "env" and TOKEN not in "\n".join(layout.describe()) + repr(layout)


def test_master_addr_and_port_win_over_the_nodelist_and_flags_win_over_both() -> None:
    env = {"SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "gpu[07-08]", "MASTER_ADDR": "10.1.0.5",
           "MASTER_PORT": "31000", "RAYLESS_CONTROL_TOKEN": TOKEN}
    _, layout, _ = resolve_layout(two_nodes(), env)
    assert layout.is_coordinator and layout.rdzv_endpoint == "10.1.0.5:31000" and layout.registry_port == 31002
    _, layout, _ = resolve_layout(two_nodes("--actor-node-rank", "1", "--rdzv-endpoint", "head:4000",
                                            "--control-port", "5000", "--control-host", "10.1.0.9"), env)
    assert layout.node_rank == 1 and layout.rdzv_endpoint == "head:4000"
    # a specific --control-host is bound on node 0 and dialled by everyone
    assert layout.control_address == "10.1.0.9:5000" and layout.registry_address == "10.1.0.9:5001"


def test_torchrun_style_launchers_give_node_rank_and_master_addr() -> None:
    env = {"NODE_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "40000", "RAYLESS_CONTROL_TOKEN": TOKEN}
    _, layout, _ = resolve_layout(two_nodes(), env)
    assert layout.node_rank == 1 and layout.control_bind == "127.0.0.1" and layout.control_host == "127.0.0.1"
    assert "NODE_RANK=1" in layout.source and "MASTER_ADDR=127.0.0.1" in layout.source
    # SLURM_NODEID outside an srun step (no nodelist) is not taken for the node rank
    _, layout, _ = resolve_layout(two_nodes(), {**env, "SLURM_NODEID": "0"})
    assert layout.node_rank == 1


@pytest.mark.parametrize(("flags", "env", "message"), [
    ((), {"SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "n[1-3]"}, r"SLURM_NODEID='2': expected this node's rank, 0\.\.1"),
    ((), {"SLURM_NODEID": "0", "SLURM_NNODES": "3", "SLURM_JOB_NODELIST": "n[1-3]"},
     "SLURM_NNODES=3 nodes, but --actor-num-nodes is 2"),
    ((), {"NODE_RANK": "0"}, "node 0's address is unknown"),
    (("--control-host", "127.0.0.1"), {"NODE_RANK": "0", "MASTER_ADDR": "gpu1"},
     "--control-host 127.0.0.1 cannot be reached from the other nodes"),
    ((), {"NODE_RANK": "0", "MASTER_ADDR": "gpu1", "MASTER_PORT": "65534"}, "MASTER_PORT='65534'"),
    ((), {"SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "n[1-"}, "SLURM_JOB_NODELIST: unbalanced brackets"),
])
def test_an_inconsistent_layout_is_refused_naming_the_variable(flags: tuple[str, ...], env: dict[str, str],
                                                               message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve_layout(two_nodes(*flags), {**env, "RAYLESS_CONTROL_TOKEN": TOKEN})


def test_a_lenient_layout_warns_and_shows_placeholders() -> None:
    _, layout, warnings = resolve_layout(two_nodes(), {}, lenient=True)
    assert layout is not None and layout.master_host == "<MASTER_ADDR>" and layout.token.kind == "missing"
    assert any("this node's rank is unknown" in w for w in warnings)
    assert any("every node needs the control token" in w for w in warnings)


def test_loopback_is_told_without_dns() -> None:
    assert is_loopback("localhost") and is_loopback("127.0.1.1") and is_loopback("[::1]")
    assert not is_loopback("gpu-node07") and not is_loopback("10.0.0.1")


# -- the control token ---------------------------------------------------------------------------------------
def test_node_0_creates_the_token_file_0600_once_and_every_node_reads_the_same(tmp_path: Path) -> None:
    path = tmp_path / "token"
    first = create_or_read_token_file(path)
    assert len(first) == 64 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert create_or_read_token_file(path) == first  # never replaced
    assert [p.name for p in tmp_path.iterdir()] == ["token"]  # the temporary file is gone

    async def read() -> str:
        return await TokenSource("file", path=str(path)).obtain(create=False, timeout_s=1)

    assert anyio.run(read) == first


def test_a_token_file_others_may_read_or_a_link_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(TOKEN)
    path.chmod(0o644)
    flags = ("--control-token-file", str(path))
    with pytest.raises(ConfigError, match="mode 0644 lets others read or write it; it must be 0600"):
        token_source(two_nodes(*flags), {})
    link = tmp_path / "link"
    path.chmod(0o600)
    link.symlink_to(path)
    with pytest.raises(ConfigError, match="cannot be opened"):
        token_source(two_nodes("--control-token-file", str(link)), {})
    with pytest.raises(ConfigError, match=r"directory .* does not exist"):
        token_source(two_nodes("--control-token-file", str(tmp_path / "no" / "token")), {})
    source, _ = token_source(two_nodes(*flags), {"RAYLESS_CONTROL_TOKEN": "ignored-because-the-file-wins"})
    assert source.kind == "file"


def test_an_environment_token_must_look_like_one_and_is_never_shown() -> None:
    with pytest.raises(ConfigError, match=r"RAYLESS_CONTROL_TOKEN .*: a control token must be 16"):
        token_source(two_nodes(), {"RAYLESS_CONTROL_TOKEN": "short"})
    source, _ = token_source(two_nodes(), {"RAYLESS_CONTROL_TOKEN": TOKEN})
    assert TOKEN not in source.describe() + repr(source)


async def test_node_k_waits_for_node_0s_token_file_and_gives_up_naming_it(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import coordinator.plan.token as token_module

    path = tmp_path / "token"
    source = TokenSource("file", path=str(path))
    reads: list[str | None] = []  # what node k's reads of the file found
    read = token_module.read_token_file

    def counted_read(*args: Any, **kwargs: Any) -> str | None:
        reads.append(read(*args, **kwargs))
        return reads[-1]

    monkeypatch.setattr(token_module, "read_token_file", counted_read)

    async def node_0_writes_later() -> None:
        await wait_until(lambda: reads.count(None), until=lambda misses: misses >= 2, timeout=10,
                         what="node k reading the token file in vain twice")
        await anyio.to_thread.run_sync(create_or_read_token_file, path)

    async with anyio.create_task_group() as tg:
        tg.start_soon(node_0_writes_later)
        token = await source.obtain(create=False, timeout_s=10)
    assert token == (await anyio.Path(path).read_text()).strip()
    with pytest.raises(ControlTokenError, match=r"--control-token-file .*missing: node 0 did not create it"):
        await TokenSource("file", path=str(tmp_path / "missing")).obtain(create=False, timeout_s=0.6)


# -- the wire contract ----------------------------------------------------------------------------------------
def hello_body(**changes: object) -> bytes:
    fields = {"kind": "node_hello", "version": wire.VERSION, "token": TOKEN, "node_rank": 1, "num_nodes": 2,
              "pid": 42, "host": "gpu2", **changes}
    return msgpack.packb({k: v for k, v in fields.items() if v is not None})


def test_a_node_hello_is_decoded_strictly() -> None:
    assert wire.decode_node_hello(hello_body()).node_rank == 1
    for body, message in [
        (hello_body(token="x" * (protocol.MAX_TOKEN_CHARS + 1)), r"malformed hello: .* length <= 1024 - at `\$.token`"),
        (hello_body(extra=1), "malformed hello: Object contains unknown field `extra`"),
        (hello_body(pid=None), "missing required field `pid`"),
        (hello_body(node_rank=-1), r"Expected `int` >= 0 - at `\$.node_rank`"),
        (hello_body(pid=1 << 31), r"Expected `int` <= 2147483647 - at `\$.pid`"),
        (hello_body(num_nodes=True), r"Expected `int`, got `bool` - at `\$.num_nodes`"),
        (hello_body(host=["a"]), r"Expected `str`, got `array` - at `\$.host`"),
        (hello_body(host="h" * 256), r"length <= 255 - at `\$.host`"),
        (hello_body(token=msgpack.ExtType(1, b"x")), r"Expected `str`, got `ext` - at `\$.token`"),
        (hello_body(kind="ping"), "expected node_hello as the first message, got 'ping'"),
        (hello_body(kind=None), "expected node_hello as the first message, got None"),
        (hello_body(version=wire.VERSION + 1), f"protocol version mismatch: node speaks {wire.VERSION + 1}, node 0"),
        (msgpack.packb(msgpack.ExtType(1, b"x")), "malformed hello: Expected `object`, got `ext`"),
        (b"\xc1", "malformed hello"),
        (b"x" * (wire.MAX_HELLO_BYTES + 1), "handshake limit"),
    ]:
        with pytest.raises(wire.WireError, match=message):
            wire.decode_node_hello(body)


def test_after_the_handshake_only_known_messages_with_their_fields_pass() -> None:
    up = wire.EngineUp(name="rollout-1", url="http://10.0.0.2:30000", pid=7)
    assert wire.decode(wire.encode(up)[protocol.HEADER.size:]) == up
    assert wire.decode(wire.encode(wire.NodeWelcome(markers=[["/d", "m", "n"]]))[4:]).markers == [["/d", "m", "n"]]
    for value, message in [
        ({"kind": "node_hello"}, "unknown message kind 'node_hello'"),  # a hello only opens the connection
        ({"kind": "nope"}, "unknown message kind 'nope'"),
        ({"kind": "engine_up", "name": "a", "url": "u", "pid": "7"}, r"Expected `int`, got `str` - at `\$.pid`"),
        ({"kind": "engine_up", "name": "a", "url": "u", "pid": 7, "more": 1}, "unknown field `more`"),
        ({"kind": "engine_up", "name": "a"}, "missing required field `url`"),
        ({"kind": "shared_dirs", "not_shared": [1]}, r"Expected `str`, got `int` - at `\$.not_shared\[0\]`"),
        ([1, 2], "Expected `object`, got `array`"),
    ]:
        with pytest.raises(wire.WireError, match=message):
            wire.decode(msgpack.packb(value))


# -- the registry's handshake ---------------------------------------------------------------------------------
def registry(tmp_path: Path, port: int) -> NodeRegistry:
    _, layout, _ = resolve_layout(two_nodes("--rdzv-endpoint", f"127.0.0.1:{port - 2}"),
                                  {"NODE_RANK": "0", "RAYLESS_CONTROL_TOKEN": TOKEN})
    assert layout is not None and layout.registry_port == port
    return NodeRegistry(layout=layout, token=TOKEN, engine_nodes={"rollout-2": 1}, shared_dirs=[tmp_path],
                        handshake_timeout_s=1.0)


def free_port() -> int:
    import socket

    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port > 2 and all(_free(p) for p in (port - 2, port - 1)):
            return port
    raise RuntimeError("no free port")


def _free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


async def test_the_registry_refuses_hostile_or_wrong_peers_and_names_them(tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="rayless")
    port = free_port()
    reg = registry(tmp_path, port)

    async def exchange(body: bytes | None, header: bytes | None = None) -> wire.NodeMessage | None:
        async with await anyio.connect_tcp("127.0.0.1", port) as stream:
            if header is not None:
                await stream.send(header)
            if body is not None:
                await stream.send(protocol.HEADER.pack(len(body)) + body)
            try:
                return await wire.receive(BufferedByteReceiveStream(stream))
            except (anyio.EndOfStream, anyio.IncompleteRead):
                return None

    async with anyio.create_task_group() as tg:
        await tg.start(reg.run)
        assert [p async for p in anyio.Path(tmp_path).glob(".rayless-shared-*")], "node 0 wrote its marker"
        wrong = await exchange(hello_body(token="w" * 32))
        assert isinstance(wrong, wire.NodeRefused) and "wrong token from node 1 (pid 42, host 'gpu2')" in wrong.reason
        zero = await exchange(hello_body(node_rank=0))
        assert isinstance(zero, wire.NodeRefused) and "node ranks 1..1 connect here" in zero.reason
        other = await exchange(hello_body(num_nodes=3))
        assert isinstance(other, wire.NodeRefused) and "--actor-num-nodes 3, node 0 with 2" in other.reason
        huge = await exchange(None, header=protocol.HEADER.pack(1 << 30))
        assert isinstance(huge, wire.NodeRefused) and "a hello is at most" in huge.reason
        silent = await exchange(None)
        assert isinstance(silent, wire.NodeRefused) and "no hello within 1 s" in silent.reason
        assert reg.nodes == {} and reg.events == []
        tg.cancel_scope.cancel()
    assert len(reg.refusals) == 5 and all(r.startswith("127.0.0.1:") for r in reg.refusals)
    logged = [r.getMessage() for r in caplog.records]
    assert any("node registry refused a connection from 127.0.0.1:" in m and "wrong token from node 1" in m
               for m in logged)
    assert TOKEN not in "\n".join(logged) and "w" * 32 not in "\n".join(logged)
    assert not [p async for p in anyio.Path(tmp_path).glob(".rayless-shared-*")], "node 0 removed its marker"


async def test_a_welcomed_node_reports_engines_and_a_restarted_node_replaces_its_old_connection(
        tmp_path: Path) -> None:
    port = free_port()
    reg = registry(tmp_path, port)
    lost: list[tuple[int, str]] = []
    first_lost = anyio.Event()
    directory = str(await anyio.Path(tmp_path).resolve())

    async def on_lost(node: int, reason: str) -> None:
        lost.append((node, reason))
        first_lost.set()

    reg.on_node_lost = on_lost

    async def join(pid: int) -> tuple[anyio.abc.SocketStream, BufferedByteReceiveStream]:
        stream = await anyio.connect_tcp("127.0.0.1", port)
        body = hello_body(pid=pid)
        await stream.send(protocol.HEADER.pack(len(body)) + body)
        buffered = BufferedByteReceiveStream(stream)
        welcome = await wire.receive(buffered)
        assert isinstance(welcome, wire.NodeWelcome) and welcome.markers[0][0] == directory
        assert shared.unseen(welcome.markers) == []
        return stream, buffered

    async with anyio.create_task_group() as tg:
        await tg.start(reg.run)
        first, first_in = await join(100)
        await wire.send(first, wire.EngineUp(name="rollout-2", url="http://127.0.0.1:1234", pid=5))
        with anyio.fail_after(5):
            url, serial = await reg.wait_up("rollout-2", newer_than=0, timeout=5)
        assert url == "http://127.0.0.1:1234" and reg.node_host(1) == "127.0.0.1"
        with pytest.raises(EngineError, match=r"node 1 did not report it within 0 s .*node 1 is connected"):
            await reg.wait_up("rollout-2", newer_than=serial, timeout=0.3)
        await wire.send(first, wire.EngineUp(name="rollout-0", url="http://x:1", pid=5))  # not node 1's engine
        with anyio.fail_after(5):
            await first_lost.wait()
        assert "sent an invalid message: node 1 reports engine 'rollout-0'" in lost[0][1]
        second, _ = await join(200)  # the node's process started again
        third, _ = await join(300)  # and again, before node 0 saw the second one end
        with pytest.raises((anyio.EndOfStream, anyio.IncompleteRead)):
            with anyio.fail_after(5):
                while True:
                    await wire.receive(first_in)  # node 0 closed the old connection
        tg.cancel_scope.cancel()
    assert [(e[0], e[1]) for e in reg.events] == [(1, "joined"), (1, "lost"), (1, "back"), (1, "lost"), (1, "back")]
    assert "replaced by a new process (pid 300)" in lost[1][1]
    for stream in (first, second, third):
        await stream.aclose()


# -- engines over nodes, shared directories -----------------------------------------------------------------
@pytest.mark.parametrize(("count", "nodes", "shares"), [
    (4, 2, [[0, 1], [2, 3]]), (5, 2, [[0, 1, 2], [3, 4]]), (1, 2, [[0], []]), (3, 4, [[0], [1], [2], []]),
    (2, 1, [[0, 1]]), (0, 2, [[], []]),
])
def test_engines_split_over_nodes_in_blocks_the_first_taking_one_more(count: int, nodes: int,
                                                                      shares: list[list[int]]) -> None:
    assert [list(engine_share(count, nodes, node)) for node in range(nodes)] == shares


def test_only_a_directory_both_nodes_see_passes_the_marker_check(tmp_path: Path) -> None:
    node0_dir, elsewhere = tmp_path / "shared", tmp_path / "local"
    markers = shared.write_markers([node0_dir])
    assert shared.unseen(markers) == []
    moved = [[str(elsewhere), name, nonce] for _, name, nonce in markers]  # same name, another filesystem
    assert shared.unseen(moved) == [str(elsewhere)]
    forged = [[directory, name, "an old run's nonce"] for directory, name, _ in markers]
    assert shared.unseen(forged) == [str(node0_dir.resolve())]
    assert shared.unseen([[str(tmp_path), "../../etc/passwd", "x"]]) == [str(tmp_path)]
    shared.remove_markers(markers)
    assert shared.unseen(markers) == [str(node0_dir.resolve())]
    assert os.listdir(node0_dir) == []
