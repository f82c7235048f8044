"""The control channel: frames and typed messages round-trip; the handshake refuses wrong tokens, wrong
protocol versions and oversized frames with clear errors on both sides; a rank that disconnects fails
pending calls at once.

The socket tests run a real TrainGroup listener (attach mode: it launches nothing) and real rank-side
clients (`RankChannel`) in threads. Those clients answer commands with a tiny handler instead of a
trainer: a protocol-level stand-in for a rank, so these tests need no torch process.
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable

import anyio
import msgpack
import numpy as np
import pytest
import torch

from coordinator.train.errors import RankCommandError, RankFailure
from coordinator.train.group import TrainGroup
from coordinator.train.torchrun import TorchrunSpec
from tests.support.memory import PeakMemory
from tests.support.train_settings import init_command
from tests.support.waiting import wait_until
from workers import protocol
from workers.protocol.arrays import Kind, PackedArray


def hello(
    token: str, *, rank: int = 0, world_size: int = 1, version: int = protocol.PROTOCOL_VERSION
) -> protocol.Hello:
    return protocol.Hello(
        protocol_version=version, token=token, rank=rank, world_size=world_size, local_rank=rank, pid=12345
    )


def step_metrics(loss: float) -> protocol.StepMetrics:
    return protocol.StepMetrics(
        loss=loss,
        pg_loss=loss,
        loss_tokens=4.0,
        clipped_tokens=1.0,
        entropy_sum=2.0,
        kl_sum=0.0,
        logprob_abs_diff_sum=0.5,
        num_tokens=12.0,
        logprob_abs_diff_max=0.25,
        grad_norm=1.5,
        lr=1e-3,
        step_time_s=0.1,
    )


def roundtrip(message: protocol.ControlMessage) -> protocol.Message:
    """Through a frame and back, by the typed decoder (the hello by the handshake's) and from plain values."""
    data = protocol.encode_frame(message)
    (length,) = protocol.HEADER.unpack(data[:4])
    assert length == len(data) - 4
    if isinstance(message, protocol.Hello):
        return protocol.decode_hello(data[4:])
    back = protocol.decode_body(data[4:])
    assert protocol.encode_frame(protocol.decode_message(protocol.unpack(data[4:]))) == data
    return back


def test_every_message_kind_round_trips() -> None:
    messages: list[protocol.Message] = [
        hello("secret"),
        protocol.Welcome(),
        protocol.ErrorMessage("no"),
        protocol.Request(7, init_command({"model_path": "/m", "lr": 1e-3, "hook_args": {"a": [1, 2]}})),
        protocol.Request(
            8,
            protocol.TrainCommand(
                3, [[protocol.WireSample([1, 2, 3], 1, [1], [-0.5], advantage=0.5)], []], [1, 0]
            ),
        ),
        protocol.Request(9, protocol.SaveCommand(3, "/ckpt", {"data": {"epoch": 1}})),
        protocol.Request(10, protocol.LoadCommand("/ckpt")),
        protocol.Request(11, protocol.ExportWeightsCommand("/w", "5", keep=3)),
        protocol.Request(12, protocol.WeightManifestCommand()),
        protocol.Request(13, protocol.BroadcastWeightsCommand("127.0.0.1", 29500, 3, "g", 5.0)),
        protocol.Request(14, protocol.DestroyWeightGroupCommand("g")),
        protocol.Request(15, protocol.ShutdownCommand()),
        protocol.Request(16, protocol.OffloadCommand(verify=True)),
        protocol.Request(17, protocol.OnloadCommand()),
        protocol.Request(18, protocol.ForwardBackwardCommand(
            [protocol.TinkerDatum([1, 2], [2, 3], logprobs=[-1.0, -2.0], advantages=[0.5, 0.5])], "ppo",
            {"clip_low_threshold": 0.7}, forward_only=True)),
        protocol.Request(19, protocol.OptimStepCommand(1e-3, 0.9, 0.95, 1e-12, grad_clip_norm=1.0)),
        protocol.Response(16, False, None, "ValueError: bad", "Traceback ..."),
        *(protocol.Response(20 + index, True, reply) for index, reply in enumerate(every_reply())),
    ]
    for message in messages:
        assert roundtrip(message) == message


def every_reply() -> list[protocol.Reply]:
    """One reply of each kind, its fields set (the defaults too where the other ranks answer them)."""
    return [
        protocol.InitReply(num_parameters=10, trainable_parameters=4, device="cpu"),
        protocol.TrainResult([step_metrics(0.25)]),
        protocol.SaveReply("/ckpt/tmp-3"),
        protocol.PublishReply("/ckpt/rollout_3"),
        protocol.PublishReply(),
        protocol.SaveHfReply("/hf"),
        protocol.LoadReply(rollout_id=3, extra={"rollout_state": {"next": 4}}, path="/ckpt/rollout_3"),
        protocol.ExportWeightsReply("/w/weights-5", [("w", "float32", [2, 3])]),
        protocol.WeightManifestReply([[("a", "bfloat16", [4])], [("b", "float32", [])]]),
        protocol.BroadcastWeightsReply(ok=True, joined=True, buckets=2, bytes=24, seconds=0.5),
        protocol.BroadcastWeightsReply(),
        protocol.DestroyWeightGroupReply(destroyed=True),
        protocol.OffloadReply(seconds=0.1, state_bytes=48, memory={"rss_bytes": 1 << 20}, digest="ab"),
        protocol.OnloadReply(seconds=0.2, state_bytes=48),
        protocol.ShutdownReply(),
        protocol.ForwardBackwardReply(logprobs=[[-0.5, -1.0]], elementwise_loss=[[0.5, 1.0]], loss_sum=1.5),
        protocol.OptimStepReply(grad_norm=2.0),
    ]


def test_every_command_declares_one_reply_of_its_own_kind() -> None:
    """One record per command: the reply's kind is the command's, and a Response holds only replies."""
    commands = {kind: cls for kind, cls in protocol.CONTROL.kinds().items() if issubclass(cls, protocol.Command)}
    assert {kind: cls.reply.kind for kind, cls in commands.items()} == {kind: kind for kind in commands}
    assert sorted(protocol.REPLY_KINDS) == sorted(commands)
    assert sorted({reply.kind for reply in every_reply()}) == sorted(commands)
    with pytest.raises(protocol.ProtocolError, match=r"unknown message kind 'welcome' at `\$.result`"):
        protocol.decode_message({"kind": "response", "request_id": 1, "ok": True, "result": {"kind": "welcome"}})
    with pytest.raises(protocol.ProtocolError, match=r"Expected `object \| null`, got `str` - at `\$.result`"):
        protocol.decode_message({"kind": "response", "request_id": 1, "ok": True, "result": "path"})
    load = {"kind": "load", "rollout_id": 3, "extra": {}, "path": "/p"}
    with pytest.raises(protocol.ProtocolError, match=r"unknown field `step` - at `\$.result`"):
        protocol.decode_message({"kind": "response", "request_id": 1, "ok": True, "result": {**load, "step": 1}})
    with pytest.raises(protocol.ProtocolError, match=r"Expected `int`, got `str` - at `\$.result.rollout_id`"):
        protocol.decode_message({"kind": "response", "request_id": 1, "ok": True,
                                 "result": {**load, "rollout_id": "3"}})
    with pytest.raises(protocol.ProtocolError, match=r"Expected `str`, got `int` - at `\$.result.buckets\[0\]\[0\]\[1\]`"):
        protocol.decode_message({"kind": "response", "request_id": 1, "ok": True,
                                 "result": {"kind": "weight_manifest", "buckets": [[["w", 4, [1]]]]}})


def test_tensors_round_trip_exactly() -> None:
    tensors = {
        "f32": torch.randn(3, 4),
        "bf16": torch.randn(5).to(torch.bfloat16),
        "i64": torch.arange(6).reshape(2, 3),
        "empty": torch.empty(0, 7),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "strided": torch.randn(4, 4).t(),
    }
    # a free-form map (a save's `extra`) may carry tensors: the extension type, never a pickle
    back = roundtrip(protocol.Request(1, protocol.SaveCommand(1, "/ckpt", {"tensors": tensors})))
    assert isinstance(back, protocol.Request) and isinstance(back.command, protocol.SaveCommand)
    for name, tensor in tensors.items():
        got = back.command.extra["tensors"][name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert torch.equal(got, tensor), name


def test_malformed_messages_raise_protocol_errors() -> None:
    with pytest.raises(protocol.ProtocolError, match="unknown message kind 'nope'"):
        protocol.decode_message({"kind": "nope"})
    with pytest.raises(protocol.ProtocolError, match="unknown field `extra`"):
        protocol.decode_message({"kind": "welcome", "protocol_version": 1, "extra": 2})
    with pytest.raises(protocol.ProtocolError, match="missing required field `message`"):
        protocol.decode_message({"kind": "error"})
    with pytest.raises(protocol.ProtocolError, match=r"Expected `int`, got `str` - at `\$.request_id`"):
        protocol.decode_message({"kind": "request", "request_id": "1", "command": {"kind": "shutdown"}})
    with pytest.raises(protocol.ProtocolError, match=r"unknown message kind 'welcome' at `\$.command`"):
        protocol.decode_message({"kind": "request", "request_id": 1, "command": {"kind": "welcome"}})
    with pytest.raises(protocol.ProtocolError, match="unknown message kind 'hello'"):  # only the handshake's
        protocol.decode_body(protocol.encode_frame(hello("t"))[4:])
    with pytest.raises(protocol.ProtocolError, match="cannot encode a object"):
        protocol.pack({"x": object()})
    with pytest.raises(protocol.ProtocolError, match="unknown msgpack ext type"):
        protocol.unpack(msgpack.packb(msgpack.ExtType(9, b"")))


def test_records_decode_typed_and_refuse_unknown_or_missing_fields() -> None:
    sent = protocol.TrainCommand(0, [[protocol.WireSample([4, 5], 1, [1], [-1.0])]], [1])
    request = roundtrip(protocol.Request(1, sent))
    assert isinstance(request, protocol.Request) and isinstance(request.command, protocol.TrainCommand)
    assert request.command.steps[0][0] == protocol.WireSample([4, 5], 1, [1], [-1.0], advantage=0.0)
    body = protocol.unpack(protocol.pack(protocol.TrainResult([step_metrics(0.5)]).to_wire()))
    assert body["kind"] == "train" and protocol.TrainResult.from_wire(body).steps == [step_metrics(0.5)]

    # plain values as `unpack` gives them: a per-token array is its PackedArray (a list is not one)
    sample = {"tokens": PackedArray.of(Kind.TOKENS, [1, 2]), "response_length": 1,
              "loss_mask": PackedArray.of(Kind.MASK, [1]), "rollout_log_probs": PackedArray.of(Kind.FLOATS, [0.0])}
    train = {"kind": "train", "rollout_id": 0, "step_loss_tokens": [1]}
    with pytest.raises(protocol.ProtocolError, match=r"unknown field `reward` - at `\$.steps\[0\]\[0\]`"):
        protocol.decode_message({**train, "steps": [[{**sample, "reward": 1.0}]]})
    with pytest.raises(protocol.ProtocolError, match=r"missing required field `loss_mask` - at `\$.steps\[0\]\[0\]`"):
        protocol.decode_message({**train, "steps": [[{k: v for k, v in sample.items() if k != "loss_mask"}]]})
    with pytest.raises(protocol.ProtocolError, match=r"Expected `array`, got `object` - at `\$.steps\[0\]`"):
        protocol.decode_message({**train, "steps": [sample]})
    with pytest.raises(protocol.ProtocolError, match=r"Expected `PackedArray`, got `list` - at `\$.steps\[0\]\[0\].tokens`"):
        protocol.decode_message({**train, "steps": [[{**sample, "tokens": [1, 2]}]]})
    metrics = step_metrics(0.5).to_wire()
    with pytest.raises(protocol.ProtocolError, match=r"a TrainResult: Object contains unknown field `sum` - at `\$.steps\[0\]`"):
        protocol.TrainResult.from_wire({"steps": [{**metrics, "sum": {}}]})
    with pytest.raises(protocol.ProtocolError, match=r"Expected `float`, got `str` - at `\$.steps\[0\].lr`"):
        protocol.TrainResult.from_wire({"steps": [{**metrics, "lr": "fast"}]})
    with pytest.raises(protocol.ProtocolError, match=r"Expected `float`, got `bool` - at `\$.steps\[0\].extra\[\.\.\.\]`"):
        protocol.TrainResult.from_wire({"steps": [{**metrics, "extra": {"m": True}}]})
    with pytest.raises(protocol.ProtocolError, match=r"Expected `array`, got `null` - at `\$.steps`"):
        protocol.TrainResult.from_wire({"steps": None})


def test_sender_refuses_a_frame_over_the_limit() -> None:
    with pytest.raises(protocol.FrameTooLarge, match="exceeds the control-channel limit of 1000 bytes"):
        protocol.frame({"blob": b"x" * 2000}, max_frame_bytes=1000)


# ---------------------------------------------------------------------------------- real sockets


async def start_listener(tg: anyio.abc.TaskGroup, world_size: int = 1, **kwargs: object) -> TrainGroup:
    group = TrainGroup(TorchrunSpec(nproc_per_node=world_size), run_dir=kwargs.pop("run_dir"), launch=False, **kwargs)  # type: ignore[arg-type]
    tg.start_soon(group.run)
    await group.listening.wait()
    return group


def serve_in_thread(
    channel: protocol.RankChannel, handler: Callable[[protocol.Request], protocol.Response | None]
) -> threading.Thread:
    """The stand-in rank's command loop: answers until shutdown, or closes when the handler returns None."""

    def loop() -> None:
        try:
            while True:
                request = channel.receive()
                assert isinstance(request, protocol.Request)
                if isinstance(request.command, protocol.ShutdownCommand):
                    channel.send(protocol.Response(request.request_id, True, protocol.ShutdownReply()))
                    return
                response = handler(request)
                if response is None:
                    return
                channel.send(response)
        except ConnectionError:
            return
        finally:
            channel.close()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


async def test_wrong_token_is_refused_with_a_clear_error(tmp_path) -> None:
    async with anyio.create_task_group() as tg:
        group = await start_listener(tg, run_dir=tmp_path)
        with pytest.raises(protocol.HandshakeRefused, match="wrong token from rank 0"):
            await anyio.to_thread.run_sync(
                protocol.RankChannel.connect, group.address, hello("not-the-token")
            )
        assert any("wrong token" in reason for reason in group.refusals)
        assert not group.ready.is_set()
        tg.cancel_scope.cancel()


async def test_wrong_protocol_version_is_refused(tmp_path) -> None:
    async with anyio.create_task_group() as tg:
        group = await start_listener(tg, run_dir=tmp_path)
        with pytest.raises(protocol.HandshakeRefused, match="protocol version mismatch: rank speaks 999"):
            await anyio.to_thread.run_sync(
                protocol.RankChannel.connect, group.address, hello(group.token, version=999)
            )
        tg.cancel_scope.cancel()


async def test_frame_over_the_limit_is_refused_by_the_receiver(tmp_path) -> None:
    async with anyio.create_task_group() as tg:
        group = await start_listener(tg, run_dir=tmp_path, max_frame_bytes=4096)

        def send_huge_header() -> str:
            host, port = protocol.split_address(group.address or "")
            with socket.create_connection((host, port), timeout=10) as sock:
                # Announce 1 MiB before any Hello; the coordinator must refuse after the header, without
                # reading a body, whatever its post-handshake limit.
                sock.sendall(struct.pack(">I", 1 << 20))
                channel = protocol.RankChannel(sock)
                reply = channel.receive()
                assert isinstance(reply, protocol.ErrorMessage)
                return reply.message

        message = await anyio.to_thread.run_sync(send_huge_header)
        assert "1048576 bytes" in message and f"a hello is at most {protocol.MAX_HELLO_BYTES} bytes" in message
        assert any("a hello is at most" in reason for reason in group.refusals)

        # Once welcomed, the group's own limit applies: a rank announcing 1 MiB fails the call, naming it.
        channel = await anyio.to_thread.run_sync(protocol.RankChannel.connect, group.address, hello(group.token))

        def answer_too_much(request: protocol.Request) -> None:
            channel.sock.sendall(struct.pack(">I", 1 << 20))

        thread = serve_in_thread(channel, answer_too_much)
        with anyio.fail_after(10), pytest.raises(RankFailure, match="over the control-channel limit of 4096 bytes"):
            await group.commands.weight_manifest()
        await anyio.to_thread.run_sync(thread.join, 10)
        tg.cancel_scope.cancel()


async def test_rank_side_receiver_refuses_an_oversized_frame() -> None:
    left, right = socket.socketpair()
    with left, right:
        right.sendall(struct.pack(">I", 10_000))
        with pytest.raises(protocol.FrameTooLarge, match="over the control-channel limit of 100 bytes"):
            protocol.RankChannel(left, max_frame_bytes=100).receive()


async def test_commands_reach_every_rank_and_errors_name_the_rank(tmp_path) -> None:
    async with anyio.create_task_group() as tg:
        group = await start_listener(tg, world_size=2, run_dir=tmp_path, error_window_s=0.2)
        seen: dict[int, list[str]] = {0: [], 1: []}

        def make_handler(rank: int) -> Callable[[protocol.Request], protocol.Response]:
            def handle(request: protocol.Request) -> protocol.Response:
                seen[rank].append(request.command.kind)
                if isinstance(request.command, protocol.LoadCommand) and rank == 1:
                    return protocol.Response(
                        request.request_id, False, error="CheckpointError: no such dir", traceback="tb"
                    )
                reply: protocol.Reply = (
                    protocol.LoadReply(rollout_id=4, extra={}, path="/p")
                    if isinstance(request.command, protocol.LoadCommand)
                    else protocol.WeightManifestReply([[("w", "float32", [2])]])
                )
                return protocol.Response(request.request_id, True, reply)

            return handle

        threads = []
        for rank in (0, 1):
            channel = await anyio.to_thread.run_sync(
                protocol.RankChannel.connect, group.address, hello(group.token, rank=rank, world_size=2)
            )
            threads.append(serve_in_thread(channel, make_handler(rank)))
        await group.ready.wait()
        assert sorted(group.ranks) == [0, 1]
        assert await group.commands.weight_manifest() == [("w", "float32", [2])]
        with pytest.raises(
            RankCommandError, match=r"command 'load' failed on rank\(s\) 1: CheckpointError: no such dir"
        ):
            await group.commands.load("/nowhere")
        # Ranks may be out of step after a failed command: the group refuses further calls.
        with pytest.raises(RuntimeError, match="unusable after an earlier failed command"):
            await group.commands.weight_manifest()
        assert seen == {0: ["weight_manifest", "load"], 1: ["weight_manifest", "load"]}
        await group.shutdown()
        for thread in threads:
            await anyio.to_thread.run_sync(thread.join, 10)
            assert not thread.is_alive()


async def test_a_rank_that_disconnects_fails_the_pending_call_at_once(tmp_path) -> None:
    async with anyio.create_task_group() as tg:
        group = await start_listener(tg, world_size=2, run_dir=tmp_path)
        release = threading.Event()

        def answer_slowly(request: protocol.Request) -> protocol.Response:
            release.wait(30)
            return protocol.Response(request.request_id, True, protocol.WeightManifestReply([]))

        def disconnect(request: protocol.Request) -> None:
            return None  # closes the socket, like a rank that died

        threads = []
        for rank, handler in ((0, answer_slowly), (1, disconnect)):
            channel = await anyio.to_thread.run_sync(
                protocol.RankChannel.connect, group.address, hello(group.token, rank=rank, world_size=2)
            )
            threads.append(serve_in_thread(channel, handler))
        await group.ready.wait()
        with anyio.fail_after(10):
            with pytest.raises(
                RankFailure, match=r"training rank\(s\) 1 failed: rank 1 \(pid 12345\) closed"
            ) as info:
                await group.commands.weight_manifest()
        assert info.value.ranks == [1]
        release.set()
        await group.shutdown()
        for thread in threads:
            await anyio.to_thread.run_sync(thread.join, 10)


async def test_a_rank_that_stops_reading_a_large_command_is_in_flight_and_its_end_fails_the_call(tmp_path) -> None:
    """The command is in flight (what the rank watch reads to name, and past the deadline end, a rank) from its
    first byte, not once every frame is sent: a rank that stops reading a frame larger than the sockets hold is
    named as waiting while the send waits; when it ends, the send fails and so does the call, naming it."""
    async with anyio.create_task_group() as tg:
        group = await start_listener(tg, run_dir=tmp_path)
        channel = await anyio.to_thread.run_sync(protocol.RankChannel.connect, group.address, hello(group.token))
        await group.ready.wait()  # the stand-in rank never reads: its buffers fill and the send waits
        tokens = 8 << 20  # 32 MiB of int32 tokens, well over what two sockets hold
        command = protocol.TrainCommand(0, [[protocol.WireSample(PackedArray.of(Kind.TOKENS, np.arange(tokens, dtype=np.int32)), 1,
                                                                 [1], [-0.5])]], [1])
        failure: list[BaseException] = []

        async def call() -> None:
            try:
                await group.server.call({0: command})
            except RankFailure as error:
                failure.append(error)

        with anyio.fail_after(60):
            async with anyio.create_task_group() as calls:
                calls.start_soon(call)
                # the call encodes its frame off the event loop first, then sends it
                in_flight = await wait_until(lambda: group.server.in_flight, what="the command in flight",
                                             timeout=30)
                await anyio.wait_all_tasks_blocked()
                assert in_flight.waiting() == [0] and not failure  # sending, watched
                channel.close()  # the rank ends (as the watch ends one past its deadline)
        assert failure and failure[0].ranks == [0]  # type: ignore[attr-defined]
        assert group.server.in_flight is None
        await group.shutdown()


async def test_a_reconnected_rank_makes_the_group_usable_again(tmp_path) -> None:
    def answer(request: protocol.Request) -> protocol.Response:
        return protocol.Response(request.request_id, True, protocol.WeightManifestReply([[("w", "float32", [1])]]))

    async with anyio.create_task_group() as tg:
        group = await start_listener(tg, world_size=2, run_dir=tmp_path)
        channels = {}
        for rank in (0, 1):
            channels[rank] = await anyio.to_thread.run_sync(
                protocol.RankChannel.connect, group.address, hello(group.token, rank=rank, world_size=2)
            )
        thread0 = serve_in_thread(channels[0], answer)
        with anyio.fail_after(10):
            await group.wait_for_ranks()
        channels[1].close()  # rank 1 dies
        with anyio.fail_after(10), pytest.raises(RankFailure, match=r"rank\(s\) 1 failed"):
            await group.commands.weight_manifest()
        restarted = hello(group.token, rank=1, world_size=2)
        restarted.restart_count = 1
        channel = await anyio.to_thread.run_sync(protocol.RankChannel.connect, group.address, restarted)
        thread1 = serve_in_thread(channel, answer)
        with anyio.fail_after(10):
            ranks = await group.wait_for_ranks()
        assert ranks[1].restart_count == 1
        assert await group.commands.weight_manifest() == [("w", "float32", [1])]
        await group.shutdown()
        for thread in (thread0, thread1):
            await anyio.to_thread.run_sync(thread.join, 10)


async def test_a_rank_answering_with_another_commands_reply_fails_that_rank(tmp_path) -> None:
    """The coordinator reads a reply only as the record its command declares: another kind is the rank's
    protocol error (the call fails naming the rank), never a value read by key."""

    def answer_wrongly(request: protocol.Request) -> protocol.Response:
        return protocol.Response(request.request_id, True, protocol.LoadReply(rollout_id=1, extra={}, path="/p"))

    async with anyio.create_task_group() as tg:
        group = await start_listener(tg, run_dir=tmp_path)
        channel = await anyio.to_thread.run_sync(protocol.RankChannel.connect, group.address, hello(group.token))
        thread = serve_in_thread(channel, answer_wrongly)
        await group.ready.wait()
        with anyio.fail_after(10), pytest.raises(
            RankFailure, match=r"rank 0 .* sent an invalid message: answered a 'weight_manifest' command with a "
                               r"'load' reply"):
            await group.commands.weight_manifest()
        await group.shutdown()
        await anyio.to_thread.run_sync(thread.join, 10)


# ------------------------------------------------------------------------------ before authentication


def hostile_hellos() -> dict[str, bytes]:
    """Frames a peer without the token might send first (each with its 4-byte header)."""

    def framed(body: bytes) -> bytes:
        return protocol.HEADER.pack(len(body)) + body

    fields = {"kind": "hello", "protocol_version": protocol.PROTOCOL_VERSION, "token": "guess", "rank": 0,
              "world_size": 1, "local_rank": 0, "pid": 1, "restart_count": 0}  # fmt: skip
    # 0.9 MB: a tensor whose shape is 100,000 dimensions of 2**64 - 1 (was: 34.5 s of bigint products)
    huge_shape = msgpack.ExtType(protocol.TENSOR_EXT, msgpack.packb(["float32", [2**64 - 1] * 100_000, b""]))
    count = 8 * 1024 * 1024  # 8 MiB of empty arrays (was: ~600 MiB decoded before the token check)
    return {
        "tensor shape": framed(msgpack.packb({**fields, "token": huge_shape})),
        "empty arrays": framed(b"\xdd" + count.to_bytes(4, "big") + b"\x90" * count),
        "small tensor": framed(msgpack.packb({**fields, "token": msgpack.ExtType(protocol.TENSOR_EXT, b"")})),
        "huge rank": framed(msgpack.packb({**fields, "rank": 2**64 - 1})),
        "bool rank": framed(msgpack.packb({**fields, "rank": True})),
        "extra field": framed(msgpack.packb({**fields, "config": {"a": [1, 2]}})),
        "token list": framed(msgpack.packb({**fields, "token": ["guess"]})),
        "not a map": framed(msgpack.packb([fields])),
        "request": framed(msgpack.packb({"kind": "request", "request_id": 1})),
    }


def test_decode_hello_accepts_a_hello_and_refuses_every_other_shape() -> None:
    real = protocol.encode_frame(hello("t", rank=3, world_size=4))
    assert protocol.decode_hello(real[4:]) == hello("t", rank=3, world_size=4)
    for name, data in hostile_hellos().items():
        with pytest.raises(protocol.ProtocolError):
            protocol.decode_hello(data[4:])
            pytest.fail(f"the {name!r} Hello was accepted")


async def test_a_peer_without_the_token_cannot_stall_or_inflate_the_coordinator(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """Hostile first frames arrive while a welcomed rank answers calls: every call still answers within a
    second, the coordinator's peak memory barely moves, and each peer is refused and logged by address."""
    frames = hostile_hellos()
    caplog.set_level("WARNING", logger="coordinator.train.channel")
    async with anyio.create_task_group() as tg:
        group = await start_listener(tg, run_dir=tmp_path)
        channel = await anyio.to_thread.run_sync(protocol.RankChannel.connect, group.address, hello(group.token))
        thread = serve_in_thread(channel, lambda r: protocol.Response(r.request_id, True,
                                                                     protocol.WeightManifestReply([])))
        await group.ready.wait()
        host, port = protocol.split_address(group.address or "")
        peers: list[str] = []
        replies: list[protocol.Message | None] = []

        def attack(data: bytes) -> None:
            with socket.create_connection((host, port), timeout=30) as sock:
                local_host, local_port = sock.getsockname()[:2]
                peers.append(f"{local_host}:{local_port}")
                try:
                    sock.sendall(data)
                    replies.append(protocol.RankChannel(sock).receive())
                except OSError:  # refused after the header: the rest of the frame meets a closed socket
                    replies.append(None)

        latencies: list[float] = []
        memory = PeakMemory()
        async with anyio.create_task_group() as attackers:
            for data in frames.values():
                attackers.start_soon(anyio.to_thread.run_sync, attack, data)
            while len(replies) < len(frames) or len(latencies) < 20:
                started = anyio.current_time()
                with anyio.fail_after(30):
                    assert await group.commands.weight_manifest() == []
                latencies.append(anyio.current_time() - started)
                await anyio.sleep(0.01)
        growth = memory.growth_mib
        assert max(latencies) < 1.0, sorted(latencies)[-5:]
        assert growth < 32, f"the coordinator's peak memory rose {growth:.0f} MiB"
        assert len(group.refusals) == len(frames), group.refusals
        assert all(isinstance(reply, protocol.ErrorMessage | None) for reply in replies)
        for peer in peers:
            assert f"refused a connection from {peer}: " in caplog.text, peer
        assert sorted(group.ranks) == [0]  # the welcomed rank was never disturbed
        await group.shutdown()
        await anyio.to_thread.run_sync(thread.join, 10)


def test_a_tensor_shape_is_checked_before_any_arithmetic_on_it() -> None:
    # after the handshake too: 100,000 dimensions of 2**64 - 1 used to cost seconds of bigint products
    for shape in ([2**64 - 1] * 100_000, [protocol.MAX_TENSOR_DIM + 1], [-1], ["2"], [1] * 65):
        tensor = msgpack.ExtType(protocol.TENSOR_EXT, msgpack.packb(["float32", shape, b""]))
        with pytest.raises(protocol.ProtocolError, match="the shape must be at most 64 sizes"):
            protocol.unpack(msgpack.packb({"t": tensor}))
