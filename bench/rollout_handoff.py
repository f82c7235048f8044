"""Benchmark: one rollout handed to the ranks over the control channel, against the same bytes over loopback.

Issue 38's figure: 512 samples × 8,192 tokens (1,024 prompt + 7,168 response: 4.2 M tokens, 3.7 M mask entries
and logprobs) to 2 ranks. Measured, alternating in one run:
- ours: from the coordinator's `Sample`s to both ranks holding their micro-batches' tensors, through the real
  control server — `WireSample.from_sample` and `plan_steps` (as `TrainCommands.train` prepares a rollout), then
  `ControlServer.call` (every rank's frame encoded off the event loop, sent rank after rank) to 2 rank processes
  that joined with `RankChannel.connect` (Hello, token) and, per command, `receive` it (the typed decode), run
  `packing.plan` / `packing.pack_groups` over every step (the tensors the trainer trains on; `pack` group by
  group on a checkout without it) and answer a `TrainResult`;
- the floor: the same frames' bytes sent over a second loopback socket to the same processes, read into a buffer.
Each round hands the rollout off up to three times, alternating: its samples as plain lists (a custom rollout
function's), packed ahead (`pack_sample_ahead`, as the default rollout leaves an accepted group's samples; what
that packing cost, moved into the rollout, is printed once), and replayed (written with the dump writer and read
back by `replay.reader`, as a replay run's loader gives them; the read's cost, in the loader, is printed once).
`--lists-only` skips the last two; a checkout without `pack_sample_ahead` has no packed-ahead rounds. The frames
are checked bit-identical across the three. The coordinator and the ranks tune their collectors first, as a run's
do (`tune_collector`): without it, full passes over the three copies of the rollout held here (~240 ms each) and
over a rank's imports (~50 ms) land in a round or two. Reported per kind: medians of each, the ratio (target ≤ 3×) and the channel's alone (ours less the coordinator's
preparation and encoding, as `bench.train_shapes` reports it), a rank's decode in wall and CPU seconds, CPU seconds
on the path against the floor's, and the coordinator's RSS growth while handing off (sampled every 2 ms)
against one copy of the frames.

    python -m bench.rollout_handoff [--samples 512] [--tokens 8192] [--prompt 1024] [--repeats 5]

Runs against any checkout with the same public names (`PYTHONPATH=<checkout>`), so main's figure is measured
with the same script. About 60–120 CPU-seconds with the defaults (building the samples is a third of it).
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import os
import secrets
import socket
import statistics
import struct
import threading
import time
from pathlib import Path

QWEN3_VOCAB = 151_936
_REPORT = struct.Struct("<dddd")  # a rank's (receive s, decode s, receive CPU s, decode CPU s)


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """The highest RSS seen while the block runs, sampled by a thread."""

    def __init__(self, every_s: float = 0.002) -> None:
        self.every_s, self.peak, self._stop = every_s, 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            self._stop.wait(self.every_s)

    def __enter__(self) -> PeakRss:
        self.peak = rss_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def build_samples(count: int, tokens: int, prompt: int, seed: int = 0) -> list:
    """Samples as the generate path leaves them: plain int and float lists, distinct values."""
    import numpy as np

    from replay.sample import Sample, SampleStatus

    rng = np.random.default_rng(seed)
    response = tokens - prompt
    batch = []
    for index in range(count):
        mask = [1] * response
        mask[:: 97] = [0] * len(mask[:: 97])  # a few tool tokens
        batch.append(Sample(group_index=index // 8, sample_index=index % 8, prompt="",
                            tokens=rng.integers(0, QWEN3_VOCAB, tokens).tolist(), response_length=response,
                            loss_mask=mask, rollout_log_probs=(-rng.random(response) * 3).tolist(), reward=1.0,
                            status=SampleStatus.COMPLETED, advantage=float(rng.normal())))
    return batch


def tune_as_a_run_does(*, rank: bool) -> None:
    """The collector tuned as the checkout's run tunes it before its first hand-off (start-up's heap frozen, fewer
    passes): the coordinator's since issue 38's generate-path work, a rank's since `workers.collector`."""
    try:
        from workers.collector import tune_collector
    except ImportError:  # a checkout from before it: only the coordinator tuned it, in the rollout manager
        if rank:
            return
        try:
            from coordinator.rollout.manager import tune_collector  # type: ignore[attr-defined,no-redef]
        except ImportError:
            return
    if rank:
        tune_collector(collect_first=False)  # type: ignore[call-arg]
    else:
        tune_collector()


def rank_process(control: str, token: str, rank: int, floor_address: tuple[str, int], max_tokens: int) -> None:
    """One rank: joins the control channel as the real rank does; per round one TrainCommand (received, decoded,
    its steps packed into micro-batch tensors, answered) then one floor frame read raw from the second socket;
    after each, (receive s, decode s, receive CPU s, decode CPU s) on the floor socket."""
    from workers import protocol
    from workers.train_rank import packing

    tune_as_a_run_does(rank=True)
    hello = protocol.Hello(protocol_version=protocol.PROTOCOL_VERSION, token=token, rank=rank, world_size=2,
                           local_rank=rank, pid=os.getpid())
    channel = protocol.RankChannel.connect(control, hello, max_frame_bytes=2**40)
    raw = socket.create_connection(floor_address)
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    floor_channel = protocol.RankChannel(raw, 2**40)
    while True:
        cpu = time.process_time()
        try:
            length = protocol.HEADER.unpack(channel._receive_exactly(4))[0]
        except ConnectionError:  # the bench is over
            return
        received_at = time.perf_counter()  # the first bytes: the coordinator has encoded
        body = channel._receive_exactly(length)
        received, receive_cpu = time.perf_counter(), time.process_time() - cpu
        cpu = time.process_time()
        request = protocol.decode_body(body)
        del body
        steps = request.command.steps
        pack_groups = getattr(packing, "pack_groups", None)  # as the trainer builds a step's micro-batches
        for samples in steps:
            groups = packing.plan(samples, max_tokens=max_tokens, micro_batch_size=None)
            if pack_groups is not None:
                pack_groups(samples, groups, 0)
            else:  # a checkout from before pack_groups
                for group in groups:
                    packing.pack([samples[i] for i in group], 0)
        decoded, decode_cpu = time.perf_counter(), time.process_time() - cpu
        metrics = protocol.StepMetrics(0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0)
        channel.send(protocol.Response(request.request_id, True, protocol.TrainResult([metrics] * len(steps))))
        del request, steps
        raw.sendall(_REPORT.pack(received - received_at, decoded - received, receive_cpu, decode_cpu))
        cpu = time.process_time()
        length = protocol.HEADER.unpack(floor_channel._receive_exactly(4))[0]
        floor_channel._receive_exactly(length)
        raw.sendall(_REPORT.pack(0.0, 0.0, time.process_time() - cpu, 0.0))


def read_reports(conns: list[socket.socket]) -> list[tuple[float, float, float, float]]:
    reports = []
    for conn in conns:
        data = b""
        while len(data) < _REPORT.size:
            chunk = conn.recv(_REPORT.size - len(data))
            if not chunk:
                raise ConnectionError("a rank process closed its connection")
            data += chunk
        reports.append(_REPORT.unpack(data))
    return reports


async def hand_off(server: object, samples: list, ranks: int) -> tuple[float, float, float]:
    """Ours: (wall seconds until every rank has its tensors and answered, the coordinator's seconds to prepare
    the rollout, the coordinator's CPU seconds in all)."""
    import anyio

    from coordinator.train.planning import plan_steps
    from workers import protocol
    from workers.protocol.train_settings import BatchingSettings

    def prepare() -> list:
        wire = [protocol.WireSample.from_sample(sample) for sample in samples]
        return plan_steps(wire, BatchingSettings(), ranks)

    started, cpu = time.perf_counter(), time.process_time()
    plan = await anyio.to_thread.run_sync(prepare)  # as TrainCommands.train does
    prepared = time.perf_counter()
    commands = {rank: protocol.TrainCommand(rollout_id=0, steps=[step.shards[rank] for step in plan],
                                            step_loss_tokens=[step.loss_tokens for step in plan])
                for rank in range(ranks)}
    del plan
    await server.call(commands)  # type: ignore[attr-defined]
    return time.perf_counter() - started, prepared - started, time.process_time() - cpu


def floor(frames: list[bytes], conns: list[socket.socket]) -> tuple[float, float]:
    """(wall seconds until every rank has read its bytes, CPU seconds of the send and the slowest read)."""
    started, cpu = time.perf_counter(), time.process_time()
    for conn, frame in zip(conns, frames, strict=True):
        conn.sendall(frame)
    cpu = time.process_time() - cpu
    reports = read_reports(conns)
    return time.perf_counter() - started, cpu + max(report[2] for report in reports)


def replay_of(samples: list) -> tuple[list, float]:
    """`samples` as a replay run reads them: written to a dump by `replay.format.write_dump`, read back by
    `replay.reader.read_dump` (outside any timing); with the read's CPU seconds."""
    import tempfile

    from replay.format import write_dump
    from replay.reader import read_dump

    with tempfile.TemporaryDirectory() as directory:
        path = write_dump(Path(directory) / "0.rld", 0, samples, config_facts={})
        cpu = time.process_time()
        replayed = read_dump(path).samples
        return replayed, time.process_time() - cpu


def frames_of(samples: list, ranks: int) -> list[bytes]:
    """Each rank's frame, as the control server encodes it (built outside any timing: the floor's bytes)."""
    from coordinator.train.planning import plan_steps
    from workers import protocol
    from workers.protocol.train_settings import BatchingSettings

    plan = plan_steps([protocol.WireSample.from_sample(sample) for sample in samples], BatchingSettings(), ranks)
    return [bytes(protocol.encode_frame(protocol.Request(rank + 1, protocol.TrainCommand(
        0, [step.shards[rank] for step in plan], [step.loss_tokens for step in plan])), 2**40))
        for rank in range(ranks)]


async def run(args: argparse.Namespace) -> None:
    import anyio

    from coordinator.train.channel import ControlServer
    from workers import protocol

    tune_as_a_run_does(rank=False)
    ranks = 2
    token = secrets.token_hex(16)
    server = ControlServer(world_size=ranks, token=token, max_frame_bytes=2**40)
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    floor_listener = socket.create_server(("127.0.0.1", 0))
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=rank_process, args=(f"127.0.0.1:{port}", token, rank,
                                                             floor_listener.getsockname(), 8192))
                 for rank in range(ranks)]
    async with anyio.create_task_group() as group:
        group.start_soon(server.serve, listener, group)
        for process in processes:
            process.start()
        await server.wait_all_connected(120)
        conns = []
        for _ in processes:
            conn, _ = await anyio.to_thread.run_sync(floor_listener.accept)
            conns.append(conn)
        samples = build_samples(args.samples, args.tokens, args.prompt)
        frames = frames_of(samples, ranks)
        variants = {"lists": samples}
        pack_ahead = getattr(protocol, "pack_sample_ahead", None)
        ahead_cpu = 0.0
        if pack_ahead is not None and not args.lists_only:
            # as the generate path leaves them: each accepted group's samples packed while others generate
            ahead = [dataclasses.replace(sample) for sample in samples]
            cpu = time.process_time()
            for sample in ahead:
                pack_ahead(sample)
            ahead_cpu = time.process_time() - cpu
            variants["packed ahead"] = ahead
            assert frames_of(ahead, ranks) == frames, "packed ahead, the frames must be the same bytes"
        read_cpu = 0.0
        if not args.lists_only:
            replayed, read_cpu = replay_of(samples)
            variants["replayed"] = replayed
            assert frames_of(replayed, ranks) == frames, "replayed, the frames must be the same bytes"
        print(f"protocol {protocol.PROTOCOL_VERSION}: {len(samples)} samples, "
              f"{sum(len(s.tokens) for s in samples):,} tokens, {sum(s.response_length for s in samples):,} "
              f"response tokens, {ranks} rank processes, load {os.getloadavg()[0]:.1f}")
        if ahead_cpu:
            print(f"packing ahead (moved into the rollout, at each group's acceptance): {ahead_cpu:.3f} CPU-s, "
                  f"{ahead_cpu / len(samples) * 1e3:.3f} ms a sample; the frames are bit-identical")
        if read_cpu:
            print(f"reading the rollout's dump back (the replay loader's work, before the hand-off): "
                  f"{read_cpu:.3f} CPU-s, {read_cpu / len(samples) * 1e3:.3f} ms a sample")
        first_growth = 0
        names = ("ours", "prepare", "coordinator_cpu", "floor", "floor_cpu", "growth", "decode", "decode_cpu",
                 "path_cpu")
        by_variant: dict[str, dict[str, list[float]]] = {
            variant: {name: [] for name in names} for variant in variants}
        for repeat in range(args.repeats + 1):  # round 0 warms up (the ranks' first decode imports)
            for variant, batch in variants.items():  # alternating in each round
                figures = by_variant[variant]
                baseline = rss_bytes()
                with PeakRss() as peak:
                    wall, prepare_s, coordinator_cpu = await hand_off(server, batch, ranks)
                reports = await anyio.to_thread.run_sync(read_reports, conns)
                floor_s, floor_cpu = await anyio.to_thread.run_sync(floor, frames, conns)
                if repeat == 0:  # the process's first hand-off: its heap grows here, later rounds may reuse it
                    first_growth = max(first_growth, peak.peak - baseline)
                    continue
                row = {"ours": wall, "prepare": prepare_s, "coordinator_cpu": coordinator_cpu, "floor": floor_s,
                       "floor_cpu": floor_cpu, "growth": peak.peak - baseline,
                       "decode": max(report[1] for report in reports), "decode_cpu": max(r[3] for r in reports),
                       "path_cpu": coordinator_cpu + max(report[2] + report[3] for report in reports)}
                for name, value in row.items():
                    figures[name].append(value)
                print(f"  round {repeat} ({variant}): ours {wall:.3f} s (preparing {prepare_s:.3f} s; coordinator "
                      f"{coordinator_cpu:.3f} CPU-s; a rank's decode + tensors {row['decode']:.3f} s, "
                      f"{row['decode_cpu']:.3f} CPU-s), floor {floor_s:.3f} s; CPU-s on the path "
                      f"{row['path_cpu']:.3f} vs {floor_cpu:.3f}; RSS +{row['growth'] / 2**20:.0f} MiB")
        group.cancel_scope.cancel()
    for conn in conns:
        conn.close()
    for process in processes:
        process.kill()
        process.join(30)
    size = sum(len(frame) for frame in frames)
    for variant, figures in by_variant.items():
        median = {name: statistics.median(values) for name, values in figures.items()}
        ratios = ", ".join(f"{ours / floor_s:.1f}" for ours, floor_s in zip(figures["ours"], figures["floor"],
                                                                             strict=True))
        print(f"{variant}: ours {median['ours']:.3f} s vs loopback floor {median['floor']:.3f} s for "
              f"{size / 2**20:.1f} MiB: {median['ours'] / median['floor']:.1f}× (target ≤ 3×; rounds {ratios}); "
              f"a rank's decode + tensors {median['decode']:.3f} s = {median['decode_cpu']:.3f} CPU-s")
        print(f"  CPU seconds on the path (the coordinator's + the slowest rank's receive and decode, against the "
              f"floor's send + slowest read; less bent by other load than wall time): {median['path_cpu']:.3f} vs "
              f"{median['floor_cpu']:.3f}: {median['path_cpu'] / median['floor_cpu']:.1f}×; the coordinator's "
              f"{median['coordinator_cpu']:.3f} CPU-s of it")
        print(f"  coordinator RSS growth while handing off: later rounds up to {max(figures['growth']) / 2**20:.0f} "
              f"MiB; one copy of the frames is {size / 2**20:.0f} MiB")
    print(f"the process's first hand-off grew its RSS by {first_growth / 2**20:.0f} MiB; load now "
          f"{os.getloadavg()[0]:.1f}")


def main() -> None:
    import anyio

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lists-only", action="store_true",
                        help="only the samples as plain lists (no rounds with them packed ahead)")
    anyio.run(run, parser.parse_args())


if __name__ == "__main__":
    main()
