"""Each engine's generation rate (tokens/s) for the status document, from its own Prometheus counter.

Owns `EngineRates`: while the status server runs, every `interval` seconds it reads `/metrics` of each alive
engine (one request each, concurrently, each bounded by `timeout`) and turns the change of
`…generation_tokens_total` (SGLang's `sglang:generation_tokens_total`, which the CPU engine serves too) into a
rate. Invariants: an engine that does not answer, or whose counter went back (a relaunch), has no rate until
two readings of one incarnation agree; nothing runs when the status server is off.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import anyio

from coordinator.engines.errors import EngineError
from coordinator.engines.policy import NO_RETRY

if TYPE_CHECKING:
    from coordinator.engines.client import EngineClient
    from coordinator.engines.fleet import EngineFleet, EngineHandle

log = logging.getLogger("rayless")


def generation_tokens(text: str) -> float | None:
    """The sum of every `…generation_tokens_total` sample in Prometheus text; None when there is none."""
    from prometheus_client.parser import text_string_to_metric_families

    total, found = 0.0, False
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.endswith("generation_tokens_total"):
                    total += float(sample.value)
                    found = True
    except ValueError:
        return None
    return total if found else None


class EngineRates:
    """tokens/s by engine name, refreshed by `run` (a task of the status service)."""

    def __init__(self, *, client: EngineClient, fleets: list[EngineFleet], interval: float = 2.0,
                 timeout: float = 2.0) -> None:
        self.client = client
        self.fleets = fleets
        self.interval = interval
        self.timeout = timeout
        self.rates: dict[str, float] = {}
        self._last: dict[str, tuple[int, float, float]] = {}  # name -> (incarnation, time, tokens)

    async def run(self) -> None:
        while True:
            engines = [h for fleet in self.fleets for h in fleet.alive()]
            async with anyio.create_task_group() as group:
                for handle in engines:
                    group.start_soon(self._read, handle)
            alive = {h.name for h in engines}
            for name in list(self.rates):
                if name not in alive:
                    del self.rates[name]
            await anyio.sleep(self.interval)

    async def _read(self, handle: EngineHandle) -> None:
        incarnation, url = handle.incarnation, handle.url
        tokens = None
        with anyio.move_on_after(self.timeout):
            try:
                text = await self.client.engine(url).metrics(timeout=self.timeout, retry=NO_RETRY)
                tokens = generation_tokens(text)
            except EngineError as error:  # a status figure never fails the run
                log.debug("status: /metrics of %s unanswered: %r", handle.name, error)
        if tokens is None:
            self.rates.pop(handle.name, None)
            return
        now = time.monotonic()
        last = self._last.get(handle.name)
        self._last[handle.name] = (incarnation, now, tokens)
        if last is None or last[0] != incarnation or tokens < last[2] or now <= last[1]:
            self.rates.pop(handle.name, None)
            return
        self.rates[handle.name] = (tokens - last[2]) / (now - last[1])
