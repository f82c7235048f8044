"""Weight updates of a real CPU engine: from a safetensors directory, and over a gloo group that SGLang's own
`init_custom_process_group` (from the real sglang wheel) forms in this process, as a trainer built for SGLang does.

Each update must change what the engine computes to exactly what the new weights give (checked against
transformers in this process), report the new weight_version, and a rejected update must keep the old
weights and version.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import torch

from tests.support.engine_proc import free_port, start_engine

PROMPT = "1 2 3="
PROMPT_IDS: list[int] = []  # filled by the `prompt_ids` fixture with the model's tokenizer
BODY = {
    "text": PROMPT,
    "return_logprob": True,
    "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True},
}


@pytest.fixture(scope="module", autouse=True)
def prompt_ids(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    PROMPT_IDS[:] = AutoTokenizer.from_pretrained(str(tiny_model_dir)).encode(PROMPT)


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir: Path) -> Iterator[str]:
    with start_engine(tiny_model_dir) as url:
        yield url


@pytest.fixture
async def client(engine_url: str) -> Any:
    async with httpx.AsyncClient(base_url=engine_url, timeout=60.0) as http:
        yield http


def load_model(directory: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()


def perturbed_model(base: Path, seed: int) -> Any:
    model = load_model(base)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.5)
    return model


def expected(model: Any, prompt_ids: list[int], output_ids: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt_ids + output_ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [logprobs[len(prompt_ids) - 1 + i, t].item() for i, t in enumerate(output_ids)]


def greedy_ids(model: Any, prompt_ids: list[int], count: int) -> list[int]:
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(count):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids) :]


async def generate(client: httpx.AsyncClient) -> dict[str, Any]:
    response = await client.post("/generate", json=BODY)
    assert response.status_code == 200, response.text
    return response.json()


def logprobs_of(out: dict[str, Any]) -> list[float]:
    return [entry[0] for entry in out["meta_info"]["output_token_logprobs"]]


async def assert_engine_computes(client: httpx.AsyncClient, model: Any, version: str) -> dict[str, Any]:
    """The engine's greedy output and logprobs are those of `model`, reported under `version`."""
    out = await generate(client)
    prompt_ids = [entry[1] for entry in out["meta_info"]["input_token_logprobs"]]
    assert len(prompt_ids) == 1  # default logprob_start_len: the last prompt position only
    prompt_ids = list(PROMPT_IDS)
    assert out["output_ids"] == greedy_ids(model, prompt_ids, 8)
    assert logprobs_of(out) == pytest.approx(expected(model, prompt_ids, out["output_ids"]), abs=1e-4)
    assert out["meta_info"]["weight_version"] == version
    assert (await client.get("/model_info")).json()["weight_version"] == version
    assert (await client.get("/get_weight_version")).json() == {"weight_version": version}
    return out


async def test_update_from_disk_changes_outputs_and_bad_updates_keep_them(
    client: httpx.AsyncClient, tiny_model_dir: Path, tmp_path: Path
) -> None:
    base = load_model(tiny_model_dir)
    before = await assert_engine_computes(client, base, "default")

    new_dir = tmp_path / "step1"
    new_model = perturbed_model(tiny_model_dir, seed=1)
    new_model.save_pretrained(str(new_dir), safe_serialization=True)
    update = await client.post(
        "/update_weights_from_disk", json={"model_path": str(new_dir), "weight_version": "v1"}
    )
    assert update.status_code == 200, update.text
    assert update.json()["success"] is True
    after = await assert_engine_computes(client, new_model, "v1")
    assert logprobs_of(after) != pytest.approx(logprobs_of(before), abs=1e-3)
    assert (await client.get("/model_info")).json()["model_path"] == str(new_dir)

    from safetensors.torch import save_file

    state = {k: v.clone() for k, v in base.state_dict().items() if k != "lm_head.weight"}
    wrong_shape = dict(state, **{"model.norm.weight": torch.ones(3)})
    (tmp_path / "bad_shape").mkdir()
    save_file(wrong_shape, str(tmp_path / "bad_shape" / "model.safetensors"))
    unknown = dict(state, **{"model.not_a_layer.weight": torch.ones(3)})
    (tmp_path / "bad_name").mkdir()
    save_file(unknown, str(tmp_path / "bad_name" / "model.safetensors"))
    (tmp_path / "empty").mkdir()
    for path, needle in [
        (tmp_path / "missing", "does not exist"),
        (tmp_path / "empty", "no *.safetensors"),
        (tmp_path / "bad_shape", "shape"),
        (tmp_path / "bad_name", "model.not_a_layer.weight"),
    ]:
        refused = await client.post(
            "/update_weights_from_disk", json={"model_path": str(path), "weight_version": "bad"}
        )
        assert refused.status_code == 400
        assert refused.json()["success"] is False and needle in refused.json()["message"]
    kept = await assert_engine_computes(client, new_model, "v1")
    assert kept["output_ids"] == after["output_ids"]

    restore = await client.post(
        "/update_weights_from_disk", json={"model_path": str(tiny_model_dir), "weight_version": "default"}
    )
    assert restore.status_code == 200
    await assert_engine_computes(client, base, "default")


async def test_update_from_disk_waits_for_running_requests_or_aborts_them(
    client: httpx.AsyncClient, tiny_model_dir: Path
) -> None:
    events: list[str] = []
    long_body = {
        "text": PROMPT,
        "stream": True,
        "sampling_params": {"max_new_tokens": 300, "ignore_eos": True},
    }

    async def stream(started: anyio.Event) -> None:
        async with client.stream("POST", "/generate", json=long_body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line.removeprefix("data: "))
                    started.set()
                    if chunk["meta_info"]["finish_reason"] is not None:
                        events.append(f"stream:{chunk['meta_info']['finish_reason']['type']}")

    async def update(**extra: Any) -> None:
        response = await client.post(
            "/update_weights_from_disk",
            json={"model_path": str(tiny_model_dir), "weight_version": "default", **extra},
        )
        assert response.status_code == 200
        events.append("update")

    for extra, order in [
        ({}, ["stream:length", "update"]),
        ({"abort_all_requests": True}, ["stream:abort", "update"]),
    ]:
        events.clear()
        started = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(stream, started)
            await started.wait()
            tg.start_soon(partial(update, **extra))
        assert events == order


async def test_a_trainer_built_for_sglang_updates_the_engine_per_tensor_and_by_flattened_bucket(
    client: httpx.AsyncClient, tiny_model_dir: Path
) -> None:
    """SGLang's own `init_custom_process_group` (from the real wheel) is rank 0 here, as in a trainer written
    for SGLang: the engine joins its group, then takes weights inside a begin/end session, per tensor and as
    one flattened bucket (SGLang's `FlattenedTensorBucket` layout), and computes exactly what they give."""
    import torch.distributed as dist

    from tests.support import sglang_parts

    base = load_model(tiny_model_dir)
    await assert_engine_computes(client, base, "default")
    port = free_port()
    init_body = {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": "sglang_trainer_group",
        "backend": "gloo",
    }
    responses: dict[str, httpx.Response] = {}

    async def post(key: str, path: str, body: dict[str, Any]) -> None:
        responses[key] = await client.post(path, json=body)

    nccl = await client.post("/init_weights_update_group", json={**init_body, "backend": "nccl"})
    assert nccl.status_code == 400 and "nccl" in nccl.json()["message"]  # a CPU engine cannot join NCCL

    async with anyio.create_task_group() as tg:
        tg.start_soon(post, "init", "/init_weights_update_group", init_body)
        pg = await anyio.to_thread.run_sync(
            lambda: sglang_parts.init_custom_process_group()(
                backend="gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                world_size=2,
                rank=0,
                group_name="sglang_trainer_group",
            )
        )
    try:
        assert responses["init"].status_code == 200, responses["init"].text
        assert responses["init"].json()["success"] is True

        new_model = perturbed_model(tiny_model_dir, seed=2)
        named = [(name, p.detach()) for name, p in new_model.named_parameters()]
        update_body = {
            "names": [name for name, _ in named],
            "dtypes": ["float32"] * len(named),
            "shapes": [list(t.shape) for _, t in named],
            "group_name": "sglang_trainer_group",
            "weight_version": "dist-1",
            "flush_cache": True,
        }
        # SGLang 0.5.21+: no update outside a session (refused before anything is received).
        outside = await client.post("/update_weights_from_distributed", json=update_body)
        assert outside.status_code == 400 and "begin_weight_update" in outside.json()["message"]
        assert (await client.post("/end_weight_update", json={})).status_code == 400  # nothing to end
        begun = await client.post("/begin_weight_update", json={"selector": "all"})
        assert begun.status_code == 200 and begun.json()["success"] is True
        again = await client.post("/begin_weight_update", json={})
        assert again.status_code == 400 and "already open" in again.json()["message"]

        async with anyio.create_task_group() as tg:
            tg.start_soon(post, "update", "/update_weights_from_distributed", update_body)
            for _, tensor in named:  # a trainer's per-tensor loop, in announced order
                await anyio.to_thread.run_sync(lambda t=tensor: dist.broadcast(t, src=0, group=pg))
        assert responses["update"].status_code == 200, responses["update"].text
        await assert_engine_computes(client, new_model, "dist-1")

        # One flattened bucket: SGLang's sender-side class builds the bytes, the engine splits them.
        newer = perturbed_model(tiny_model_dir, seed=3)
        named = [(name, p.detach()) for name, p in newer.named_parameters()]
        bucket = sglang_parts.tensor_bucket_module().FlattenedTensorBucket(named_tensors=named)
        flat_body = {**update_body, "load_format": "flattened_bucket", "weight_version": "dist-2"}
        async with anyio.create_task_group() as tg:
            tg.start_soon(post, "flat", "/update_weights_from_distributed", flat_body)
            await anyio.to_thread.run_sync(
                lambda: dist.broadcast(bucket.get_flattened_tensor(), src=0, group=pg)
            )
        assert responses["flat"].status_code == 200, responses["flat"].text
        await assert_engine_computes(client, newer, "dist-2")

        # Names the model does not have: the tensors are still received (rank 0 must not block), then refused.
        bad_body = {
            **update_body,
            "names": ["model.nope"],
            "dtypes": ["float32"],
            "shapes": [[4]],
            "weight_version": "x",
        }
        async with anyio.create_task_group() as tg:
            tg.start_soon(post, "bad", "/update_weights_from_distributed", bad_body)
            await anyio.to_thread.run_sync(lambda: dist.broadcast(torch.ones(4), src=0, group=pg))
        assert responses["bad"].status_code == 400 and responses["bad"].json()["success"] is False
        assert "model.nope" in responses["bad"].json()["message"]
        await assert_engine_computes(client, newer, "dist-2")
        assert (await client.post("/end_weight_update", json={})).status_code == 200

        destroyed = await client.post("/destroy_weights_update_group", json={"group_name": "sglang_trainer_group"})
        assert destroyed.status_code == 200 and destroyed.json()["success"] is True
        again = await client.post("/destroy_weights_update_group", json={"group_name": "sglang_trainer_group"})
        assert again.status_code == 400
        await client.post("/begin_weight_update", json={})
        missing = await client.post("/update_weights_from_distributed", json=update_body)
        assert missing.status_code == 400 and "init_weights_update_group" in missing.json()["message"]
        await client.post("/end_weight_update", json={})
    finally:
        dist.destroy_process_group(pg)
        await client.post(
            "/update_weights_from_disk", json={"model_path": str(tiny_model_dir), "weight_version": "default"}
        )
