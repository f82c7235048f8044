"""One training model of the Tinker service: its torchrun ranks and the ordered queue of its requests.

Owns `TrainingModel`: started in the server's task group (`serve`), it launches its `TrainGroup`, sends `init`
(LoRA adapters as the client asked, or full fine-tuning without a LoRA config) and resolves the create_model
future; then it runs its queued requests one at a time, the lowest `seq_id` first (the SDK numbers a training
client's requests; chunks of one batch may arrive out of order). `stop` ends it: its ranks end with its task
group, and every request still queued fails with a message saying why. Invariants: a model's ranks see one
command at a time, in the client's order; a request's failure fails its future only (a dead rank fails every
later one: the group's error says which rank).
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import anyio.abc

from coordinator.tinker.futures import Future, FutureStore, UserError
from coordinator.train.commands import TrainCommands
from coordinator.train.errors import RankCommandError, RankFailure
from coordinator.train.group import TrainGroup
from coordinator.train.torchrun import TorchrunSpec
from workers.protocol.train_settings import (
    LoraSettings,
    ModelSettings,
    OptimizerSettings,
    ParallelSettings,
    TrainSettings,
)

log = logging.getLogger("rayless.tinker")

#: what a queued request does once its turn comes: the future's body and content type
Work = Callable[[TrainCommands], Awaitable[tuple[bytes, str]]]


@dataclass(order=True)
class _Job:
    seq_id: int
    order: int
    work: Work = field(compare=False)
    future: Future = field(compare=False)


class TrainingModel:
    def __init__(self, *, model_id: str, session_id: str, base_name: str, base_path: str,
                 lora: LoraSettings | None, seed: int, ranks: int, run_dir: Path, futures: FutureStore,
                 torch_threads: int = 1, data_parallel: str = "auto") -> None:
        self.model_id = model_id
        self.session_id = session_id
        self.base_name = base_name
        self.base_path = base_path
        self.lora = lora
        self.seed = seed
        self.ranks = ranks
        self.dir = run_dir / "models" / model_id
        self.futures = futures
        self.torch_threads = torch_threads
        self.data_parallel = data_parallel
        self.ready = False
        self.stopped: str | None = None  # why, once stopped
        self.steps = 0
        #: the slowest rank's own seconds for the last command of each kind (the status page's rank times)
        self.rank_seconds: dict[str, float] = {}
        self.group: TrainGroup | None = None
        self._queue: list[_Job] = []
        self._order = itertools.count()
        self._wake = anyio.Event()
        self._scope: anyio.CancelScope | None = None

    def settings(self) -> TrainSettings:
        return TrainSettings(model=ModelSettings(path=self.base_path, lora=self.lora),
                             optimizer=OptimizerSettings(lr=1e-4, clip_grad=0.0),
                             parallel=ParallelSettings(data_parallel=self.data_parallel), seed=self.seed)

    async def serve(self, created: Future | None) -> None:
        """The model's life: ranks up, `created` resolved (None: a create-from-checkpoint, whose load is queued
        first), then its queue until `stop` (or a failure)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        with anyio.CancelScope() as scope:
            self._scope = scope
            try:
                async with anyio.create_task_group() as group:
                    spec = TorchrunSpec(nproc_per_node=self.ranks)
                    self.group = await group.start(TrainGroup(spec, run_dir=self.dir,
                                                              torch_threads=self.torch_threads).run)
                    await self.group.commands.init(self.settings())
                    self.ready = True
                    if created is not None:
                        FutureStore.resolve(created, json.dumps({"model_id": self.model_id,
                                                                 "type": "create_model"}).encode())
                    await self._work(self.group.commands)
            except Exception as error:  # the ranks failed to start or died: every waiting request is told
                log.error("model %s stopped: %s", self.model_id, error)
                self.stopped = f"the model's training ranks failed: {error}"
                if created is not None and not created.done.is_set():
                    FutureStore.fail(created, self.stopped, user=False)
        self._drain(self.stopped or "the model was unloaded")

    def stop(self, why: str) -> None:
        self.stopped = self.stopped or why
        if self._scope is not None:
            self._scope.cancel()

    def queued(self) -> int:
        """Requests waiting for their turn (the one running is not counted)."""
        return len(self._queue)

    def submit(self, seq_id: int | None, work: Work) -> Future:
        if self.stopped is not None:
            raise UserError(f"model {self.model_id} is stopped: {self.stopped}")
        future = self.futures.create()
        order = next(self._order)
        heapq.heappush(self._queue, _Job(seq_id if seq_id is not None else order, order, work, future))
        self._wake.set()
        return future

    async def _work(self, commands: TrainCommands) -> None:
        while True:
            while not self._queue:
                self._wake = anyio.Event()
                await self._wake.wait()
            job = heapq.heappop(self._queue)
            try:
                body, kind = await job.work(commands)
            except UserError as error:
                FutureStore.fail(job.future, str(error), user=True)
            except RankCommandError as error:  # the ranks are fine; this command failed on them
                FutureStore.fail(job.future, f"{error.command} failed on the ranks: "
                                 f"{error.errors[min(error.errors)].error}", user=False)
            except RankFailure as error:
                FutureStore.fail(job.future, f"model {self.model_id}: its training ranks failed: {error}", user=False)
                raise  # the ranks are gone: the model stops (serve), failing what waits
            except (OSError, ValueError) as error:  # a file the work could not write or read
                FutureStore.fail(job.future, f"{type(error).__name__}: {error}", user=False)
            else:
                FutureStore.resolve(job.future, body, kind)

    def _drain(self, why: str) -> None:
        while self._queue:
            FutureStore.fail(heapq.heappop(self._queue).future, f"model {self.model_id}: {why}", user=False)
