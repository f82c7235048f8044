"""The scheduler: every sequence's state (the records are `sequences`'), and the one task that drives the model
runner step by step.

Owns the waiting queue, the running set, pause / release state, weight-update admission holds and the
counters behind /metrics. All of it is changed only on the event loop; the model runs in a worker thread
under `model_lock`, one step at a time, and its results are applied on the loop after the step returns.

Each step (continuous batching): drop the cache rows of sequences that finished, decode one token for every
running sequence together, and prefill newly admitted ones (their first token is sampled from the prefill).
A sequence joins the running batch as soon as there is room (`max_running_requests`), whatever else is mid-way.

Invariants:
- a sequence finishes exactly once (length, stop, or abort), and its request is woken when it does;
- nothing touches the runner's tensors outside `model_lock`, so weight updates never race a forward pass;
- while paused, no sequence is decoded and no new request is admitted (only health probes, which are
  prefill-only one-token generations that never join the batch);
- while any memory is released, no step runs at all and every new request (probes included) is refused with
  `MemoryReleasedError` and counted, so a released engine never computes on freed weights or answers garbage.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import anyio
import torch

from workers.boundary.json_input import JsonObject
from workers.engine.runner import ModelRunner, PrefillItem, StepOutput
from workers.engine.sampling import RequestError, RowResult, RowSampling
from workers.engine.sequences import MemoryReleasedError, RequestGroup, Seq, SeqState
from workers.engine.stops import finish_check, trim_text
from workers.vlm_processor import PixelInputs

log = logging.getLogger("rayless.engine.scheduler")

PAUSE_MODES = ("abort", "retract", "in_place")
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


class Scheduler:
    def __init__(
        self, runner: ModelRunner, *, max_running: int, weight_version: str, seed: int | None
    ) -> None:
        self.runner = runner
        self.max_running = max_running
        self.weight_version = weight_version
        self.model_lock = anyio.Lock()
        self.waiting: deque[Seq] = deque()
        self.running: dict[str, Seq] = {}
        self.paused: str | None = None
        self.released: set[str] = set()
        self.refused_while_released = 0  # /generate requests refused because memory was released
        self.probes_while_released = 0  # health probes answered "released"
        self._update_holds = 0
        self._wakeup = anyio.Event()
        self._changed = anyio.Event()
        self._seeds = random.Random(seed)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.requests_total = 0
        self._throughput: deque[tuple[float, int]] = deque(maxlen=4096)
        # --rl-on-policy-target: a sequence that ends is rescored (`rescoring`) before it is finished.
        self.rescorer: Callable[[list[tuple[list[int], list[int], PixelInputs | None]]],
                                list[list[float]]] | None = None
        self._ending: list[tuple[Seq, dict[str, Any]]] = []

    # ---- bookkeeping helpers ---------------------------------------------------------------------------

    def _wake(self) -> None:
        self._wakeup.set()

    def _signal(self) -> None:
        """Wake everything waiting in `wait_until`."""
        self._changed.set()
        self._changed = anyio.Event()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            await self._changed.wait()

    @property
    def in_flight(self) -> int:
        return len(self.waiting) + len(self.running)

    def new_generator(self, seed: int | None, index: int) -> torch.Generator:
        generator = torch.Generator()
        if seed is None:
            generator.manual_seed(self._seeds.getrandbits(63))
        else:
            # Sample i of a seeded request gets its own deterministic stream; sample 0 uses the seed itself.
            generator.manual_seed(seed if index == 0 else hash((seed, index)) & ((1 << 63) - 1))
        return generator

    def gen_throughput(self, window_s: float = 5.0) -> float:
        now = time.monotonic()
        recent = [(t, n) for t, n in self._throughput if now - t <= window_s]
        if not recent:
            return 0.0
        span = max(now - recent[0][0], 1e-3)
        return sum(n for _, n in recent) / span

    # ---- requests --------------------------------------------------------------------------------------

    async def submit(self, group: RequestGroup, *, bypass: bool = False) -> None:
        """Queue the group's sequences. Held while a weight update drains the engine (unless `bypass`)."""
        if not bypass:
            await self.wait_until(lambda: self._update_holds == 0)
        if self.released:
            if bypass:
                self.probes_while_released += 1
            else:
                self.refused_while_released += 1
            raise MemoryReleasedError(self.released)
        self.requests_total += 1
        for seq in group.seqs:
            seq.bypass_pause = bypass
            self.waiting.append(seq)
        self._wake()

    def abort(
        self, *, rid: str | None = None, abort_all: bool = False, message: str = "Abort request"
    ) -> int:
        victims = [
            seq
            for seq in [*self.waiting, *self.running.values()]
            if abort_all or (rid is not None and (seq.rid == rid or seq.public_id == rid))
        ]
        for seq in victims:
            self._finish(seq, {"type": "abort", "message": message})
        return len(victims)

    def abort_group(self, group: RequestGroup, message: str) -> None:
        for seq in group.seqs:
            if not seq.finished:
                self._finish(seq, {"type": "abort", "message": message})

    def _finish(self, seq: Seq, reason: JsonObject) -> None:
        if seq.finished:
            return
        if seq.state is SeqState.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.running.pop(seq.key, None)
        seq.state = SeqState.FINISHED
        seq.finish_reason = reason
        seq.weight_version = self.weight_version
        seq.latency = time.perf_counter() - seq.group.created
        seq.group.changed.set()
        self._signal()

    # ---- pause / release / weight-update holds ----------------------------------------------------------

    async def pause(self, mode: str) -> None:
        if mode not in PAUSE_MODES:
            raise RequestError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        self.paused = mode
        if mode == "abort":
            self.abort(abort_all=True, message="Abort by pause_generation")
        # Taking the lock waits for a step in progress, so the engine is quiet when pause returns.
        async with self.model_lock:
            if mode == "retract":
                # Drop the KV cache; the running sequences go back to the front of the queue and are
                # re-prefilled from prompt + output when generation continues.
                await anyio.to_thread.run_sync(self.runner.reset)
                for seq in reversed(list(self.running.values())):
                    seq.state = SeqState.WAITING
                    self.waiting.appendleft(seq)
                self.running.clear()
        self._signal()

    def resume(self) -> None:
        self.paused = None
        self._wake()
        self._signal()

    @asynccontextmanager
    async def exclusive_update(self) -> AsyncIterator[None]:
        """Hold new requests, wait for in-flight ones (unless paused), then own the model."""
        self._update_holds += 1
        try:
            if self.paused is None:
                await self.wait_until(lambda: self.in_flight == 0)
            async with self.model_lock:
                yield
        finally:
            self._update_holds -= 1
            self._signal()

    async def flush(self) -> bool:
        if self.in_flight:
            return False
        async with self.model_lock:
            await anyio.to_thread.run_sync(self.runner.reset)
        return True

    async def release(self, tags: set[str]) -> dict[str, int]:
        """Free the memory of `tags` (SGLang's /release_memory_occupation); returns what was freed
        (`weight_bytes`, `kv_cache_tokens`).

        As SGLang: only when nothing runs (waiting requests are allowed while generation is paused: they run
        after resume and continue)."""
        if self.running or (self.waiting and self.paused is None):
            raise RequestError(
                "release_memory_occupation needs an idle engine: requests are running or waiting "
                "(pause_generation with mode retract, or abort them, first)"
            )
        freed: dict[str, int] = {}
        async with self.model_lock:
            if "kv_cache" in tags or "weights" in tags:
                freed["kv_cache_tokens"] = self.runner.cached_tokens()
                await anyio.to_thread.run_sync(
                    lambda: self.runner.release_kv_cache(return_memory="weights" not in tags))
            if "weights" in tags:
                freed["weight_bytes"] = await anyio.to_thread.run_sync(self.runner.release_weights)
            self.released |= tags
            # A health probe that slipped in while the memory was being released cannot run now: it ends at once
            # (its handler answers "released") instead of waiting out its timeout.
            for seq in [seq for seq in self.waiting if seq.bypass_pause]:
                self._finish(seq, {"type": "abort", "message": "memory released"})
        self._signal()
        return freed

    async def resume_memory(self, tags: set[str]) -> None:
        """Take the memory of `tags` back; weights come back as they were when released."""
        async with self.model_lock:
            if "weights" in tags:
                await anyio.to_thread.run_sync(self.runner.restore_weights)
            self.released -= tags
        self._wake()
        self._signal()

    # ---- the step loop ---------------------------------------------------------------------------------

    def _has_work(self) -> bool:
        if self.released:
            return False
        if self.paused is not None:
            return any(seq.bypass_pause for seq in self.waiting)
        return bool(self.running or self.waiting)

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            self._wakeup = anyio.Event()
            if not self._has_work():
                await self._wakeup.wait()
                continue
            async with self.model_lock:
                try:
                    await self._step()
                except Exception as exc:
                    # A failed forward must not take the server down with it: the sequences in the batch end
                    # as aborted with the error, the cache is rebuilt from scratch, and serving goes on.
                    log.exception("engine step failed; aborting the running requests")
                    for seq in list(self.running.values()):
                        self._finish(seq, {"type": "abort", "message": f"engine step failed: {exc!r}"})
                    self.runner.reset()

    def _row(self, seq: Seq) -> RowSampling:
        params = seq.params
        banned: tuple[int, ...] = ()
        if not params.ignore_eos and len(seq.output_ids) < params.min_new_tokens:
            banned = tuple(self.runner.eos_ids | params.stop_token_ids)
        banned += self.runner.vision_token_ids  # never sampled: a response image token has no image to score
        return RowSampling(
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            min_p=params.min_p,
            generator=seq.generator,
            banned_ids=banned,
            top_logprobs_num=seq.top_logprobs_num,
            token_ids=seq.token_ids_logprob,
            frequency_penalty=params.frequency_penalty,
            presence_penalty=params.presence_penalty,
            repetition_penalty=params.repetition_penalty,
            logit_bias=params.logit_bias,
            output_ids=seq.output_ids if params.penalized else (),
        )

    async def _step(self) -> None:
        runner = self.runner
        drop = [key for key in runner.rows if key not in self.running]
        admitted: list[Seq] = []
        decode: dict[str, RowSampling] | None = None
        if self.paused is not None:
            admitted = [seq for seq in self.waiting if seq.bypass_pause]
        else:
            decode = {key: self._row(self.running[key]) for key in runner.rows if key in self.running} or None
            room = self.max_running - len(self.running)
            admitted = list(self.waiting)[: max(room, 0)]
        if not admitted and not decode and not drop:
            return
        prefills = []
        for seq in admitted:
            self.waiting.remove(seq)
            fresh = seq.input_logprobs is None and not seq.output_ids
            if fresh:
                self.prompt_tokens_total += len(seq.prompt_ids)
            sampling = None if seq.max_new_tokens == 0 else self._row(seq)
            want_input = fresh and seq.return_logprob
            prefills.append(
                PrefillItem(
                    seq_id=seq.key,
                    tokens=seq.prompt_ids + seq.output_ids,
                    sampling=sampling,
                    input_logprob_start=seq.logprob_start if want_input else None,
                    token_ids=seq.token_ids_logprob if want_input else (),
                    top_logprobs_num=seq.top_logprobs_num if want_input else 0,
                    position_token_ids=seq.position_token_ids if want_input else None,
                    vision=seq.vision,
                )
            )
            seq.state = SeqState.RUNNING
            self.running[seq.key] = seq
        outputs = await anyio.to_thread.run_sync(
            partial(runner.step, drop=drop, prefills=prefills, decode=decode)
        )
        generated = 0
        for key, output in outputs.items():
            seq = self.running.get(key)
            if seq is None:  # aborted while the step ran; its cache row is dropped next step
                continue
            generated += self._apply(seq, output)
        if self._ending:
            await self._rescore_ending()
        if generated:
            self.generation_tokens_total += generated
            self._throughput.append((time.monotonic(), generated))

    def _apply(self, seq: Seq, output: StepOutput) -> int:
        if output.input_logprobs is not None:
            seq.input_logprobs = output.input_logprobs
            seq.input_top_logprobs = output.input_top_logprobs
            seq.input_token_ids_logprobs = output.input_token_ids_logprobs
        if output.sample is None:
            # Prefill only (max_new_tokens 0), or a health probe held by nothing: it ends here.
            self._finish(seq, {"type": "length", "length": 0})
            return 0
        self._accept(seq, output.sample)
        if seq.bypass_pause and not seq.finished:
            # Probes never stay in the batch: a paused engine must not grow its cache.
            self._finish(seq, {"type": "length", "length": len(seq.output_ids)})
        return 1

    def _accept(self, seq: Seq, sample: RowResult) -> None:
        """Append one sampled token and finish the sequence if it hit a limit (SGLang's check order)."""
        seq.output_ids.append(sample.token)
        seq.output_logprobs.append(sample.logprob)
        if seq.top_logprobs_num:
            seq.output_top_logprobs.append(sample.top_logprobs)
        if seq.token_ids_logprob:
            seq.output_token_ids_logprobs.append(sample.token_ids_logprobs)
        reason = finish_check(
            seq.params,
            seq.output_ids,
            eos_ids=self.runner.eos_ids,
            max_new_tokens=seq.max_new_tokens,
            decode=self._decode_for_stops,
        )
        if reason is not None and self.rescorer is not None:
            self._ending.append((seq, reason))
        elif reason is not None:
            self._finish(seq, reason)
        elif seq.group.stream:
            seq.group.changed.set()

    async def _rescore_ending(self) -> None:
        ending, self._ending = [(seq, reason) for seq, reason in self._ending if not seq.finished], []
        assert self.rescorer is not None
        scores = await anyio.to_thread.run_sync(
            self.rescorer, [(seq.prompt_ids, seq.output_ids, seq.vision) for seq, _ in ending])
        for (seq, reason), logprobs in zip(ending, scores, strict=True):
            seq.output_logprobs[:] = logprobs
            self._finish(seq, reason)

    def _decode_for_stops(self, ids: Iterable[int]) -> str:
        # Special tokens included, as SGLang's tail check decodes them: stop=["<|im_end|>"] matches.
        return self.runner.tokenizer.decode(list(ids), skip_special_tokens=False)

    # ---- text of a sequence ------------------------------------------------------------------------------

    def text_of(self, seq: Seq) -> str:
        params = seq.params
        ids = seq.output_ids
        reason = seq.finish_reason or {}
        if (
            reason.get("type") == "stop"
            and isinstance(reason.get("matched"), int)
            and not params.no_stop_trim
        ):
            ids = ids[:-1]
        text = self.runner.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
        return trim_text(text, reason, params.no_stop_trim)
