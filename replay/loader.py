"""The replay loader: a data source that hands the training loop rollouts read from dumps.

Owns replay mode's side of the rollout interface: `await loader.get_rollout(rollout_id, weight_version)`
returns the same `RolloutBatch` the generate path returns, so the training loop cannot tell replay from
generation. It starts nothing (no engine, router, monitor or HTTP client) and imports neither `coordinator`
nor `workers`.

Invariants: groups are rebuilt from `group_index` in the order they first appear in the dump (the order the
generate path wrote them), samples within a group keep their file order; subsampling keeps whole groups and
depends only on (seed, rollout_id, the dump), so two replays with the same seed see identical batches; a
dump whose samples do not mean what training needs (`replay.meaning`: a NaN reward, a negative index) is a
`DumpError`, never trained on.
"""

from __future__ import annotations

import random
import re
from functools import partial
from glob import escape as glob_escape
from glob import glob
from pathlib import Path
from typing import TYPE_CHECKING

import anyio.to_thread

from replay.format import ROLLOUT_ID_FIELD, DumpError, check_template, dump_path
from replay.meaning import MeaningCheck
from replay.reader import read_dump
from replay.sample import RolloutBatch, Sample

if TYPE_CHECKING:
    from workers.boundary.json_input import JsonObject

#: Metrics of a dump that time the generation that wrote it; a replay does not report them as its own.
GENERATION_TIMINGS = frozenset({"rollout/time_s", "rollout/tokens_per_s"})


class ReplayMissingError(DumpError):
    """No dump exists for a rollout id the training loop asked for."""


def group_samples(samples: list[Sample]) -> list[list[Sample]]:
    """Rebuild groups from `group_index`, groups in first-appearance order, samples in file order."""
    groups: dict[int, list[Sample]] = {}
    for sample in samples:
        groups.setdefault(sample.group_index, []).append(sample)
    return list(groups.values())


def subsample_groups(
    groups: list[list[Sample]], fraction: float, *, seed: int, rollout_id: int
) -> list[list[Sample]]:
    """A deterministic subset of whole groups, `round(fraction * n)` of them (at least one), order kept."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"--load-debug-rollout-data-subsample must be in (0, 1], got {fraction}")
    if fraction == 1.0 or not groups:
        return groups
    keep = max(1, round(fraction * len(groups)))
    # A string seed is hashed with SHA-512 by `random`, so the choice is stable across processes and
    # Python versions (no PYTHONHASHSEED dependence), and distinct per rollout id.
    rng = random.Random(f"rayless-replay:{seed}:{rollout_id}")
    chosen = sorted(rng.sample(range(len(groups)), keep))
    return [groups[i] for i in chosen]


class ReplayLoader:
    """Serves `RolloutBatch`es from dumps named by a `{rollout_id}` template (`--load-debug-rollout-data`)."""

    def __init__(
        self,
        template: str,
        *,
        subsample: float | None = None,
        seed: int = 0,
        n_samples_per_prompt: int | None = None,
    ) -> None:
        self.template = check_template(template)
        if subsample is not None and not 0.0 < subsample <= 1.0:
            raise ValueError(f"--load-debug-rollout-data-subsample must be in (0, 1], got {subsample}")
        if n_samples_per_prompt is not None and n_samples_per_prompt < 1:
            raise ValueError(f"--n-samples-per-prompt must be >= 1, got {n_samples_per_prompt}")
        self.subsample = subsample
        self.seed = seed
        self.n_samples_per_prompt = n_samples_per_prompt

    def path_for(self, rollout_id: int) -> Path:
        return dump_path(self.template, rollout_id)

    async def get_rollout(self, rollout_id: int, weight_version: str) -> RolloutBatch:
        """The rollout dumped for `rollout_id`. `weight_version` is ignored: samples keep their own versions."""
        del weight_version
        return await anyio.to_thread.run_sync(partial(self.load_rollout, rollout_id))

    def load_rollout(self, rollout_id: int) -> RolloutBatch:
        """Blocking form of `get_rollout` (file I/O and decoding), for tools and threads."""
        path = self.path_for(rollout_id)
        if not path.exists():
            raise ReplayMissingError(
                f"no replay dump for rollout {rollout_id}: {path} does not exist "
                f"(--load-debug-rollout-data template {self.template!r}; "
                f"dumps found for rollout ids {_summarise(self.available_rollout_ids())})"
            )
        dump = read_dump(path)
        if dump.header.kind != "rollout":
            raise DumpError(f"{path}: is an {dump.header.kind} dump, not a rollout dump")
        if dump.header.rollout_id != rollout_id:
            # Not fatal for users who renamed files on purpose, but the header is the truth; say so loudly.
            raise DumpError(
                f"{path}: header says rollout {dump.header.rollout_id} but the template maps it to "
                f"rollout {rollout_id}; rename the file or fix the template"
            )
        # what `rayless dump verify` checks of each sample: a NaN reward or logprob is never trained on
        meaning = MeaningCheck(repeats=False)
        for sample in dump.samples:
            meaning.add(sample)
        if meaning.summary() is not None:
            raise DumpError(f"{path}: {meaning.summary()} (rayless dump verify {path} checks the whole file)")
        groups = group_samples(dump.samples)
        self._check_group_sizes(path, dump.header.config, groups)
        total_groups = len(groups)
        if self.subsample is not None:
            groups = subsample_groups(groups, self.subsample, seed=self.seed, rollout_id=rollout_id)
        # The generate path's metrics for this rollout (when the writer stored them) come back as they were,
        # so replayed runs log the same rollout metrics; replay's own facts are added under replay/.
        # The generating run's timings are left out: this run generated nothing, so no "gen" time or rate is
        # reported for it (the progress line, the plot and the status page read these keys).
        dumped = dump.header.config.get("metrics")
        metrics: dict[str, float] = {
            str(k): float(v)
            for k, v in (dumped.items() if isinstance(dumped, dict) else ())
            if type(v) in (int, float) and k not in GENERATION_TIMINGS
        }
        metrics |= {
            "replay/groups": float(len(groups)),
            "replay/groups_in_dump": float(total_groups),
            "replay/samples": float(sum(len(g) for g in groups)),
        }
        return RolloutBatch(rollout_id=rollout_id, groups=groups, metrics=metrics)

    def _check_group_sizes(self, path: Path, config: JsonObject, groups: list[list[Sample]]) -> None:
        n = self.n_samples_per_prompt
        if n is None:
            return
        dumped_n = config.get("n_samples_per_prompt")
        if isinstance(dumped_n, int) and dumped_n != n:
            raise DumpError(
                f"{path}: dumped with n_samples_per_prompt={dumped_n}, but this run has "
                f"--n-samples-per-prompt {n}; pass the dump's value"
            )
        wrong = [(g[0].group_index, len(g)) for g in groups if len(g) != n]
        if wrong:
            raise DumpError(
                f"{path}: {len(wrong)} group(s) do not hold --n-samples-per-prompt {n} samples "
                f"(group_index, size): {wrong[:5]}{' ...' if len(wrong) > 5 else ''}"
            )

    def available_rollout_ids(self) -> list[int]:
        """Rollout ids (not eval ids) that have a file matching the template, ascending."""
        parts = re.split(f"({re.escape(ROLLOUT_ID_FIELD)})", self.template)
        regex, seen = [], False
        for part in parts:
            if part == ROLLOUT_ID_FIELD:
                regex.append(r"(?P=rollout_id)" if seen else r"(?P<rollout_id>\d+)")
                seen = True
            else:
                regex.append(re.escape(part))
        pattern = re.compile("".join(regex))
        wildcard = "".join("*" if part == ROLLOUT_ID_FIELD else glob_escape(part) for part in parts)
        found = {
            int(match.group("rollout_id"))
            for candidate in glob(wildcard)
            if (match := pattern.fullmatch(candidate)) is not None
        }
        return sorted(found)

    def state_dict(self) -> JsonObject:
        # Replay is stateless per rollout id: the batch depends on (template, seed, subsample, rollout_id) only.
        return {"kind": "replay", "seed": self.seed, "subsample": self.subsample}

    def load_state_dict(self, state: JsonObject) -> None:
        # Accept any data source's state (e.g. a checkpoint from a generate run): nothing to restore.
        del state


def _summarise(ids: list[int]) -> str:
    if not ids:
        return "none"
    if len(ids) <= 8:
        return ", ".join(map(str, ids))
    return f"{ids[0]}..{ids[-1]} ({len(ids)} files)"
