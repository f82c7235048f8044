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
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import torch

from coordinator.engines.client import EngineClient
from coordinator.weights.distributed import FLATTENED_BUCKET, DistributedUpdate, WeightSyncError
from tests.support.engine_proc import RunningEngine, start_engine_process
from tests.support.fsdp_sender import perturb
from tests.support.train_samples import reference_log_probs, synthetic_samples
from workers.train_rank.model import load_causal_lm
from workers.train_rank.weight_buckets import bucket_manifest

BUCKET_BYTES = 24 * 1024


class TorchrunSender:
    """The trainer side DistributedUpdate drives: its weight_buckets from the unsharded model, its
    broadcast_weights one torchrun of FSDP_SENDER."""

    def __init__(self, model_dir: Path, log_path: Path, ranks: int = 2) -> None:
        self.model_dir, self.log_path, self.ranks = model_dir, log_path, ranks
        self.world_size_override: int | None = None
        self.exit_codes: list[int] = []

    async def weight_buckets(self, bucket_bytes: int) -> list[list[tuple[str, str, list[int]]]]:
        model = load_causal_lm(str(self.model_dir), dtype=torch.float32, device=torch.device("cpu"))
        return [[(n, d, s) for n, d, s in bucket] for bucket in bucket_manifest(model, bucket_bytes)]

    async def broadcast_weights(self, master_address: str, master_port: int, world_size: int, group_name: str,
                                timeout_s: float, *, backend: str, bucket_bytes: int,
                                load_format: str | None) -> dict[str, Any]:
        settings = {"model_path": str(self.model_dir), "master_port": master_port, "group_name": group_name,
                    "world_size": self.world_size_override or world_size, "timeout_s": timeout_s,
                    "bucket_bytes": bucket_bytes, "load_format": load_format}
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={self.ranks}",
                   "-m", "tests.support.fsdp_sender", json.dumps(settings)]
        with self.log_path.open("ab") as log:
            process = await anyio.run_process(command, stderr=log, check=False)
        self.exit_codes.append(process.returncode)
        lines = [line for line in process.stdout.decode().splitlines() if line.startswith("{")]
        assert process.returncode == 0 and lines, f"torchrun exited {process.returncode}:\n{self.log_path.read_text()[-3000:]}"
        return json.loads(lines[-1])

    async def destroy_weight_group(self, group_name: str) -> bool:
        return False  # the ranks' processes ended with their groups


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
    sender = TorchrunSender(tiny_model_dir, tmp_path / "torchrun.log")
    samples = synthetic_samples(tiny_model_dir, 4, seed=5)
    expected_model = load_causal_lm(str(tiny_model_dir), dtype=torch.float32, device=torch.device("cpu")).eval()
    perturb(expected_model)
    with anyio.fail_after(240):
        async with EngineClient(max_connections=8) as client:
            update = DistributedUpdate(client=client, trainer=sender, host="127.0.0.1", backend="gloo",
                                       bucket_bytes=BUCKET_BYTES, load_format=FLATTENED_BUCKET, join_timeout_s=60)
            await update.run([Engine(receiver.url)], "fsdp-1")
            async with httpx.AsyncClient(base_url=receiver.url, timeout=60) as http:
                got = (await http.post("/logprobs", json={"tokens": [s.tokens for s in samples],
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
            assert time.monotonic() - started < 60
            assert sender.exit_codes == [0, 0]
