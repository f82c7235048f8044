"""Benchmark: one rollout handed to the ranks over the control channel, against the same bytes over loopback.

Issue 38's figure: 512 samples × 8,192 tokens (1,024 prompt + 7,168 response: 4.2 M tokens, 3.7 M mask entries
and logprobs) to 2 ranks. Measured, alternating in one run:
- ours: from the coordinator's `Sample`s to both ranks holding their micro-batches' tensors — the coordinator's
  `WireSample.from_sample`, `plan_steps` and one `encode_frame` per rank (what `TrainCommands.train` and the
  control server do), the frames sent rank after rank over loopback sockets (as the server sends them), and
  in each rank process `RankChannel.receive` (the typed decode) then `packing.plan` / `packing.pack` of every
  step (the tensors the trainer trains on);
- the floor: the same frames' bytes sent over the same sockets to the same processes, read into a buffer.
Reported: medians of each, the ratio (target ≤ 3×) and the channel's alone (ours less the coordinator's part,
as `bench.train_shapes` reports it), the coordinator's part and a rank's decode in wall and CPU seconds, and the coordinator's RSS growth while handing off (sampled every 2 ms) against one copy of the frames.

    python -m bench.rollout_handoff [--samples 512] [--tokens 8192] [--prompt 1024] [--repeats 5]

Runs against any checkout with the same public names (`PYTHONPATH=<checkout>`), so main's figure is measured
with the same script. About 60–120 CPU-seconds with the defaults (building the samples is a third of it).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
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


def rank_process(address: tuple[str, int], max_tokens: int) -> None:
    """One rank's side: per round a mode byte, then a frame; 'D' decodes it as the rank does and packs its
    steps' micro-batches, 'R' reads it raw; answers (receive s, decode s)."""
    from workers import protocol
    from workers.train_rank import packing

    sock = socket.create_connection(address)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    channel = protocol.RankChannel(sock, 2**40)
    while True:
        mode = sock.recv(1)
        if mode in (b"", b"Q"):
            return
        started, cpu = time.perf_counter(), time.process_time()
        if mode == b"D":
            body = channel._receive_exactly(protocol.HEADER.unpack(channel._receive_exactly(4))[0])
            received, receive_cpu = time.perf_counter(), time.process_time() - cpu
            cpu = time.process_time()
            request = protocol.decode_body(body)
            del body
            command = request.command
            for samples in command.steps:
                for group in packing.plan(samples, max_tokens=max_tokens, micro_batch_size=None):
                    packing.pack([samples[i] for i in group], 0)
            decoded, cpu = time.perf_counter(), time.process_time() - cpu
            del request, command
        else:
            length = protocol.HEADER.unpack(channel._receive_exactly(4))[0]
            channel._receive_exactly(length)
            received = decoded = time.perf_counter()
            receive_cpu, cpu = time.process_time() - cpu, 0.0
        sock.sendall(_REPORT.pack(received - started, decoded - received, receive_cpu, cpu))


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


def hand_off(samples: list, conns: list[socket.socket]
             ) -> tuple[float, float, float, float, int, list[tuple[float, float, float, float]]]:
    """Ours: (wall seconds until every rank has its tensors, coordinator seconds to the frames, their CPU
    seconds, the CPU seconds of sending them, frame bytes, the ranks' reports)."""
    from coordinator.train.planning import plan_steps
    from workers import protocol
    from workers.protocol.train_settings import BatchingSettings

    started, cpu = time.perf_counter(), time.process_time()
    wire = [protocol.WireSample.from_sample(sample) for sample in samples]
    plan = plan_steps(wire, BatchingSettings(), len(conns))
    del wire
    commands = [protocol.TrainCommand(rollout_id=0, steps=[step.shards[rank] for step in plan],
                                      step_loss_tokens=[step.loss_tokens for step in plan])
                for rank in range(len(conns))]
    del plan
    frames = [protocol.encode_frame(protocol.Request(rank + 1, command), 2**40)
              for rank, command in enumerate(commands)]
    encoded, cpu = time.perf_counter(), time.process_time() - cpu
    size = sum(len(frame) for frame in frames)
    send_cpu = time.process_time()
    for conn, frame in zip(conns, frames, strict=True):  # the server sends rank after rank
        conn.sendall(b"D")
        conn.sendall(frame)
    send_cpu = time.process_time() - send_cpu
    del frames, commands
    reports = read_reports(conns)
    return time.perf_counter() - started, encoded - started, cpu, send_cpu, size, reports


def floor(frames: list[bytes], conns: list[socket.socket]) -> tuple[float, float]:
    """(wall seconds until every rank has read its bytes, CPU seconds of the send and the slowest read)."""
    started, cpu = time.perf_counter(), time.process_time()
    for conn, frame in zip(conns, frames, strict=True):
        conn.sendall(b"R")
        conn.sendall(frame)
    cpu = time.process_time() - cpu
    reports = read_reports(conns)
    return time.perf_counter() - started, cpu + max(report[2] for report in reports)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from workers import protocol

    listener = socket.create_server(("127.0.0.1", 0))
    context = multiprocessing.get_context("spawn")
    ranks = [context.Process(target=rank_process, args=(listener.getsockname(), 8192)) for _ in range(args.ranks)]
    for process in ranks:
        process.start()
    conns = []
    for _ in ranks:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conns.append(conn)

    samples = build_samples(args.samples, args.tokens, args.prompt)
    tokens = sum(len(sample.tokens) for sample in samples)
    print(f"protocol {protocol.PROTOCOL_VERSION}: {len(samples)} samples, {tokens:,} tokens, "
          f"{sum(s.response_length for s in samples):,} response tokens, {args.ranks} rank processes, "
          f"load {os.getloadavg()[0]:.1f}")
    hand_off(samples[: 2 * args.ranks], conns)  # warm-up: the ranks' first decode imports and allocates
    ours, coordinator, coordinator_cpu, floors, growth, rank_decode, rank_cpu = [], [], [], [], [], [], []
    ours_cpu: list[float] = []
    floors_cpu: list[float] = []
    size = 0
    frames: list[bytes] = []
    for repeat in range(args.repeats):
        baseline = rss_bytes()
        with PeakRss() as peak:
            wall, encode_s, encode_cpu, send_cpu, size, reports = hand_off(samples, conns)
        growth.append(peak.peak - baseline)
        ours.append(wall)
        coordinator.append(encode_s)
        coordinator_cpu.append(encode_cpu)
        rank_decode.append(max(report[1] for report in reports))
        rank_cpu.append(max(report[3] for report in reports))
        ours_cpu.append(encode_cpu + send_cpu + max(report[2] + report[3] for report in reports))
        if not frames:  # the floor's bytes: the frames ours sent, built again outside any timing
            frames = _frames(samples, args.ranks)
        floor_s, floor_cpu = floor(frames, conns)
        floors.append(floor_s)
        floors_cpu.append(floor_cpu)
        print(f"  round {repeat + 1}: ours {wall:.3f} s (coordinator {encode_s:.3f} s, {encode_cpu:.3f} CPU-s; "
              f"a rank's decode + tensors {rank_decode[-1]:.3f} s, {rank_cpu[-1]:.3f} CPU-s), floor "
              f"{floors[-1]:.3f} s; CPU-s on the path {ours_cpu[-1]:.3f} vs {floor_cpu:.3f}; RSS "
              f"+{growth[-1] / 2**20:.0f} MiB")
    for conn in conns:
        conn.sendall(b"Q")
        conn.close()
    for process in ranks:
        process.join(30)
    listener.close()
    median = statistics.median
    channel = [wall - encode_s for wall, encode_s in zip(ours, coordinator, strict=True)]
    print(f"ours {median(ours):.3f} s (coordinator {median(coordinator):.3f} s = {median(coordinator_cpu):.3f} "
          f"CPU-s; a rank's decode + tensors {median(rank_decode):.3f} s = {median(rank_cpu):.3f} CPU-s) vs "
          f"loopback floor {median(floors):.3f} s for {size / 2**20:.1f} MiB: {median(ours) / median(floors):.1f}× "
          f"(target ≤ 3×); the channel alone (send + the ranks' decode, as bench.train_shapes reports it) "
          f"{median(channel) / median(floors):.1f}×")
    print(f"CPU seconds on the path (the coordinator's encode and send + the slowest rank's receive and decode, "
          f"against the floor's send + slowest read; less bent by other load than wall time): "
          f"{median(ours_cpu):.3f} vs {median(floors_cpu):.3f}: {median(ours_cpu) / median(floors_cpu):.1f}×")
    print(f"coordinator RSS growth while handing off: max {max(growth) / 2**20:.0f} MiB, first round "
          f"{growth[0] / 2**20:.0f} MiB; one copy of the frames is {size / 2**20:.0f} MiB")


def _frames(samples: list, ranks: int) -> list[bytes]:
    """Each rank's frame, as `hand_off` encodes it."""
    from coordinator.train.planning import plan_steps
    from workers import protocol
    from workers.protocol.train_settings import BatchingSettings

    plan = plan_steps([protocol.WireSample.from_sample(sample) for sample in samples], BatchingSettings(), ranks)
    return [protocol.encode_frame(protocol.Request(rank + 1, protocol.TrainCommand(
        0, [step.shards[rank] for step in plan], [step.loss_tokens for step in plan])), 2**40) for rank in range(ranks)]


if __name__ == "__main__":
    main()
