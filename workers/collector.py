"""The cyclic garbage collector tuned for a long-lived process whose start-up heap outlives all its work.

Owns `tune_collector`, called once by the coordinator when its rollout pieces are built and once by a training
rank when its trainer is built. Invariant: it acts once per process; objects made afterwards are collected as
before, only less often scanned.
"""

from __future__ import annotations

import gc

#: allocations (net, of objects the collector tracks) between two young-generation passes; CPython's is 700
GEN0_THRESHOLD = 10_000
_TUNED = False


def tune_collector(*, collect_first: bool = True) -> int:
    """Collect what start-up left behind (`collect_first`), freeze the rest (`gc.freeze`) and raise the collector's
    first threshold to `GEN0_THRESHOLD`: start-up's long-lived objects (transformers, torch, the tokenizer: ~400k objects) are
    never scanned again by the cyclic collector, and the work's own objects are not rescanned by a full pass
    every 70k allocations.

    Measured (issue 38): in the coordinator's generate path (`bench/rollout_overhead.py`, 8,192 samples) the
    collector took 50–75 µs of a ~100 µs sample before, 25–30 µs frozen; at 32,768 samples 22–25 µs frozen alone
    and 8–10 µs with the threshold. On a training rank (`bench/rollout_handoff.py`), a full pass over the heap of
    its imports took ~50 ms, beside a ~25 ms decode of a rollout's command, once every few commands.

    A rank passes `collect_first=False`: after its imports a collection freed 23 objects and took 80–270 ms of its
    start-up (the collector's own passes during the imports had already run); what it would free stays allocated.

    Objects frozen are still freed by reference counting; a cycle among them that dies later is not reclaimed, the
    price of not rescanning them. Once per process (a second call does nothing); returns how many objects are
    frozen."""
    global _TUNED
    if not _TUNED:
        if collect_first:
            gc.collect()
        gc.freeze()
        gc.set_threshold(GEN0_THRESHOLD, *gc.get_threshold()[1:])
        _TUNED = True
    return gc.get_freeze_count()
