"""Replay test inputs: a small valid dump, and a pickle payload with a visible side effect.

`MarkerPayload` is what a safe loader must refuse: unpickling it opens (creates) a marker file, so a test can
see whether the payload ran. `test_replay_cli.py` shows that it does run under a naive `pickle.loads`, which
is what makes its absence after the refusals in `test_replay_import.py` mean something.
"""

from __future__ import annotations

import builtins
from pathlib import Path
from typing import Any

from replay.format import write_dump
from replay.sample import Sample, SampleStatus


class MarkerPayload:
    """Unpickling this calls open(marker, "w"): the side effect a safe loader must never allow."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (builtins.open, (str(self.marker), "w"))


def write_sample_dump(path: Path, *, response_tokens: list[int] | None = None, rollout_id: int = 11) -> Path:
    response_tokens = response_tokens or [7, 8]
    samples = [
        Sample(
            group_index=g,
            sample_index=i,
            prompt="question",
            tokens=[3, 4, *response_tokens],
            response_length=len(response_tokens),
            loss_mask=[1] * len(response_tokens),
            rollout_log_probs=[-0.5] * len(response_tokens),
            reward=float(i),  # rewards 0,1 per group: mean 0.5, std 0.5
            status=SampleStatus.COMPLETED if i == 0 else SampleStatus.TRUNCATED,
            weight_versions=["2"],
            response="answer text",
        )
        for g in range(3)
        for i in range(2)
    ]
    return write_dump(
        path, rollout_id, samples, config_facts={"hf_checkpoint": "/models/tiny", "n_samples_per_prompt": 2}
    )
