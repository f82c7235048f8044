"""The FSDP2 send path (every rank gathers each bucket, rank 0 sends it), run on CPU with gloo, into SGLang's own
receive code, driven by the coordinator's `DistributedUpdate`.

The ranks are `tests.support.fsdp_sender` under torchrun: the trainer's `shard_model` and
`weight_buckets.broadcast_weights` with `collective=True`, as on GPU. The engine side is
`tests.support.sglang_receiver` (SGLang's `init_custom_process_group` and receive loop from the wheel). The
receiver must then compute exactly what the sharded model's weights give; and when an engine never joins,
both ranks must leave the send loop together (rank 0's failed join agreed on by rank 1, which would otherwise
wait alone in the first gather) within the join timeout.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import torch
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream

from coordinator.engines.client import EngineClient
from coordinator.weights.distributed import (
    FLATTENED_BUCKET,
    REPORT_GRACE_S,
    DistributedUpdate,
    WeightSyncError,
)
from tests.support.engine_proc import RunningEngine, start_engine_process
from tests.support.fsdp_sender import perturb
from tests.support.train_samples import reference_log_probs, synthetic_samples
from workers import protocol
from workers.train_rank.model import load_causal_lm
from workers.train_rank.weight_buckets import bucket_manifest

BUCKET_BYTES = 24 * 1024


class TorchrunSender:
    """The trainer side DistributedUpdate drives: its weight_buckets from the unsharded model, its
    broadcast_weights and destroy_weight_group commands to one torchrun of FSDP_SENDER, launched once (an
    async context: leaving it ends the ranks by closing their input, and `exit_code` is torchrun's)."""

    def __init__(self, model_dir: Path, log_path: Path, ranks: int = 2) -> None:
        self.model_dir, self.log_path, self.ranks = model_dir, log_path, ranks
        self.world_size_override: int | None = None
        self.answers: list[dict[str, Any]] = []
        self.exit_code: int | None = None
        self.process: Process | None = None
        self.lines: BufferedByteReceiveStream | None = None

    async def __aenter__(self) -> TorchrunSender:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={self.ranks}",
                   "-m", "tests.support.fsdp_sender", str(self.model_dir)]
        with self.log_path.open("ab") as log:
            self.process = await anyio.open_process(command, stderr=log, start_new_session=True)
        assert self.process.stdout is not None
        self.lines = BufferedByteReceiveStream(self.process.stdout)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self.process is not None and self.process.stdin is not None
        with anyio.CancelScope(shield=True):  # also when the test failed or timed out: no rank left behind
            await self.process.stdin.aclose()  # end of input: every rank leaves its loop
            with anyio.move_on_after(60):
                self.exit_code = await self.process.wait()
            if self.exit_code is None:
                os.killpg(self.process.pid, signal.SIGKILL)
            await self.process.aclose()

    async def ask(self, command: dict[str, Any]) -> dict[str, Any]:
        assert self.process is not None and self.process.stdin is not None and self.lines is not None
        await self.process.stdin.send((json.dumps(command) + "\n").encode())
        try:
            while not (line := (await self.lines.receive_until(b"\n", 1 << 20)).decode()).startswith("{"):
                pass
        except (anyio.EndOfStream, anyio.IncompleteRead):
            raise AssertionError(f"torchrun ended:\n{self.log_path.read_text()[-3000:]}") from None
        self.answers.append(json.loads(line))
        return self.answers[-1]

    async def weight_buckets(self, bucket_bytes: int) -> list[list[tuple[str, str, list[int]]]]:
        model = load_causal_lm(str(self.model_dir), dtype=torch.float32, device=torch.device("cpu"))
        return [[(n, d, s) for n, d, s in bucket] for bucket in bucket_manifest(model, bucket_bytes)]

    async def broadcast_weights(self, master_address: str, master_port: int, world_size: int, group_name: str,
                                timeout_s: float, *, backend: str, bucket_bytes: int,
                                load_format: str | None) -> protocol.BroadcastWeightsReply:
        answer = await self.ask({"op": "broadcast", "master_port": master_port, "group_name": group_name,
                                 "world_size": self.world_size_override or world_size, "timeout_s": timeout_s,
                                 "bucket_bytes": bucket_bytes, "load_format": load_format})
        return protocol.BroadcastWeightsReply.from_wire(answer)

    async def destroy_weight_group(self, group_name: str) -> bool:
        return bool((await self.ask({"op": "destroy", "group_name": group_name}))["destroyed"])


class Engine:
    def __init__(self, url: str) -> None:
        self.name, self.url, self.tp_size = "receiver", url, 1


@pytest.fixture
def receiver(tiny_model_dir: Path, tmp_path: Path) -> Any:
    with start_engine_process(tiny_model_dir, module="tests.support.sglang_receiver",
                              log_path=tmp_path / "receiver.log") as process:
        yield process


async def test_fsdp2_ranks_gather_each_bucket_together_and_rank0_sends_it(
    tiny_model_dir: Path, tmp_path: Path, receiver: RunningEngine
) -> None:
    samples = synthetic_samples(tiny_model_dir, 4, seed=5)
    expected_model = load_causal_lm(str(tiny_model_dir), dtype=torch.float32, device=torch.device("cpu")).eval()
    perturb(expected_model)
    sender = TorchrunSender(tiny_model_dir, tmp_path / "torchrun.log")
    with anyio.fail_after(240):
        async with EngineClient(max_connections=8) as client, sender:
            update = DistributedUpdate(client=client, trainer=sender, host="127.0.0.1", backend="gloo",
                                       bucket_bytes=BUCKET_BYTES, load_format=FLATTENED_BUCKET, join_timeout_s=60)
            started = time.monotonic()
            await update.run([Engine(receiver.url)], "fsdp-1")
            formed_s = time.monotonic() - started  # a whole update on this machine now: the calibration below
            async with httpx.AsyncClient(base_url=receiver.url, timeout=60) as http:
                got = (await http.post("/logprobs", json={"tokens": [s.tokens.tolist() for s in samples],
                                                          "response_lengths": [s.response_length for s in samples]}
                                       )).json()["logprobs"]
                assert (await http.get("/get_weight_version")).json() == {"weight_version": "fsdp-1"}
            for sample, logprobs in zip(samples, got, strict=True):
                want = reference_log_probs(expected_model, sample.tokens, sample.response_length)
                assert logprobs == pytest.approx(want, abs=1e-5)
                assert logprobs != pytest.approx(sample.rollout_log_probs, abs=1e-3)  # the weights did move

            # An engine that never joins (world size 3, one engine): both ranks leave together, in bounded time.
            sender.world_size_override = 3
            update.join_timeout_s = 3.0
            started = time.monotonic()
            with pytest.raises(WeightSyncError, match=r"did not form within 3 s"):
                await update.run([Engine(receiver.url)], "fsdp-2")
            # bounded: the join timeout and the engines' grace by design, the rest a round of the requests the
            # good update made, with margin (never under 60 s); a rank left waiting would hang to the fail_after
            failed_s = time.monotonic() - started
            assert failed_s < max(60.0, update.join_timeout_s + REPORT_GRACE_S + 3 * formed_s), (failed_s, formed_s)
            assert [a["joined"] for a in sender.answers if "joined" in a] == [True, False]
        assert sender.exit_code == 0  # both ranks came out of the failed update and ended when told to
