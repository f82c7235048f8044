"""Sampling for the Tinker service: one engine per base model, switched to the weights a request names.

Owns `Sampler`. Its engine (the in-repo engine on the CPU, or SGLang, as the placement would start it) is
launched on the first sampling request for its base model — or, given `--sampler-url`, a running engine
(SGLang's own) is used and never stopped here — and loads a sampler checkpoint from disk
(`/update_weights_from_disk`, the snapshot `save_weights_for_sampler` wrote: merged weights for LoRA) before
generating with it. Invariants: requests for the weights loaded now run concurrently; a switch of weights
waits until none is in flight and no request runs across a switch, so every sample's logprobs are those of the
weights its request named; the engine ends with the sampler's task group.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import anyio.abc

from coordinator.engines.api import EngineAPI
from coordinator.engines.client import EngineClient
from coordinator.engines.launch import EngineProcess, launch_engine
from coordinator.engines.spec import EngineLaunchSpec
from coordinator.tinker.futures import UserError
from coordinator.tinker.wire import SampledSequence, encode_sample_response
from workers.boundary.json_input import JsonObject, JsonValue


class Sampler:
    def __init__(self, *, name: str, path: str, run_dir: Path, client: EngineClient, engine_kind: str = "rayless",
                 engine_args: tuple[str, ...] = (), attached_url: str | None = None) -> None:
        self.name = name
        self.path = path
        self.run_dir = run_dir
        self.client = client
        self.spec = EngineLaunchSpec(kind=engine_kind, model_path=path, stop_grace=2.0,
                                     extra_args=engine_args, env=(("RAYLESS_ENGINE_THREADS", "1"),))
        self.engine: EngineProcess | None = None
        self.api: EngineAPI | None = None
        #: a running engine (--sampler-url) used instead of launching one; never stopped here
        self.attached_url = attached_url
        # the weights the engine holds: its base model's at launch; an attached engine's are not known until
        # the first request loads the ones it names
        self.current: str | None = path if attached_url is None else None
        self.in_flight = 0
        self._switch = anyio.Condition()
        self._start = anyio.Lock()

    async def _started(self) -> EngineAPI:
        async with self._start:
            if self.api is None and self.attached_url is not None:
                self.api = EngineAPI(self.client, self.attached_url)
            if self.api is None:
                self.engine = await launch_engine(self.spec, name=f"sampler-{self.name}", run_dir=self.run_dir,
                                                  client=self.client)
                self.api = EngineAPI(self.client, self.engine.url)
            return self.api

    async def stop(self) -> None:
        if self.engine is not None:
            with anyio.CancelScope(shield=True):
                await self.engine.stop()

    @asynccontextmanager
    async def _using(self, weights: str) -> AsyncIterator[EngineAPI]:
        api = await self._started()
        async with self._switch:
            while self.current != weights and self.in_flight:
                await self._switch.wait()
            if self.current != weights:
                await api.update_weights_from_disk(weights, flush_cache=True)
                self.current = weights
            self.in_flight += 1
        try:
            yield api
        finally:
            with anyio.CancelScope(shield=True):
                async with self._switch:
                    self.in_flight -= 1
                    self._switch.notify_all()

    async def sample(self, *, weights: str | None, prompt: list[int], num_samples: int, params: JsonObject,
                     prompt_logprobs: bool) -> bytes:
        """One `asample`: `num_samples` completions of `prompt` under `weights` (None: the base model), as the
        SDK's protobuf `SampleResponse`."""
        body: dict[str, JsonValue] = {"input_ids": prompt, "sampling_params": {**params, "n": num_samples},
                                      "return_logprob": True, "logprob_start_len": 0 if prompt_logprobs else -1}
        async with self._using(weights or self.path) as api:
            reply = await self.client.request_json(api.url, "POST", "/generate", json_body=body,
                                                 timeout=self.client.generate_timeout)
        outputs = reply if isinstance(reply, list) else [reply]
        sequences = []
        prompt_scores: list[float | None] | None = None
        for output in outputs:
            if not isinstance(output, dict) or not isinstance(output.get("meta_info"), dict):
                raise UserError(f"the engine answered no completion for this prompt: {str(output)[:200]}")
            meta = output["meta_info"]
            finish = meta.get("finish_reason")
            kind = finish.get("type") if isinstance(finish, dict) else None
            if kind == "abort":
                raise UserError(f"the engine refused the request: {finish.get('message', finish)}")
            lps = [float(entry[0]) for entry in meta.get("output_token_logprobs") or []]
            tokens = [int(t) for t in output.get("output_ids") or []]
            sequences.append(SampledSequence(tokens=tokens, logprobs=lps,
                                             stop_reason="length" if kind == "length" else "stop"))
            if prompt_logprobs and prompt_scores is None:
                prompt_scores = [None if entry[0] is None or not math.isfinite(float(entry[0])) else float(entry[0])
                                 for entry in meta.get("input_token_logprobs") or []]
                if prompt_scores:
                    prompt_scores[0] = None  # the first token has no context: the SDK reads None (NaN) there
        return encode_sample_response(sequences, prompt_scores)
