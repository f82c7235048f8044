"""Rewards: the router that sets `sample.reward` for a group, from a built-in reward type or a custom rm.

Owns how a response becomes a reward. Invariants kept by `RewardModel.score_group`:
- every non-aborted sample of the group gets a finite reward: a float, or a dict of floats that contains
  `--reward-key` when one is set (a dict reward without `--reward-key` is refused at once, not later);
- aborted samples are not scored (their response is cut off at an arbitrary point); their reward is 0.0;
- a custom rm that returns the wrong type, a non-finite number or (with `--group-rm`) the wrong number of
  rewards fails with an error naming the flag, the function and the sample.

Which reward scores a sample (slime's order): `--custom-rm-path` first; else the sample's own
`metadata["rm_type"]` (an `--eval-config` dataset's `rm_type` is put there; a data file may carry one per row);
else `--rm-type`. The built-in types are `coordinator.rewards.rules` (`remote_rm`:
`coordinator.rollout.remote_rm`); all but `gpqa`, `ifbench`, `random`, `deterministic_random` and `remote_rm`
need a label (`--label-key`).

Custom rms (`--custom-rm-path`), in our form or slime's (`coordinator.hooks.forms.read_reward`):
- per sample: `fn(sample)`, or slime's `fn(args, sample, **kwargs)` -> float | dict, sync or async;
- whole group (`--group-rm`): `fn(samples)`, or slime's `fn(args, samples, **kwargs)` -> a list, one reward per
  sample, in order.
A dict reward keeps its numeric entries (booleans as 0/1); slime's rms also return text (retool's `pred`),
which is kept in the sample's `metadata["reward_info"]`. With a custom generate function, a reward it set is kept
(`keep_given`: slime skips the rm for such samples); a failed sample (slime's `FAILED`) is not scored and gets
0.0, as an aborted one.
Async functions are awaited directly; the per-sample ones of a group run concurrently in a task group (a
remote reward service is not serialised). A sync custom rm runs in a worker thread (`coordinator.hooks.calls`):
a stop signal does not wait for one stuck in a blocking call (the warning names it). The built-in types run
inline on the event loop: most are microseconds, slime's math family milliseconds (sympy;
bench/reward_grading.py), `math_verify` tens of milliseconds.

What a custom rm raises: an `Exception` stops the run, naming the rm's file and line (it would fail every
sample); `SystemExit`, `KeyboardInterrupt` or a `CancelledError` of its own (a sandbox's kill or timeout) fails
that episode only: its samples get status FAILED and reward 0.0, are counted (`rollout/failed_samples`) and
logged with the traceback.
"""

from __future__ import annotations

import argparse
import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import anyio

from coordinator.hooks.calls import HookEscaped, call_hook, log_escape
from coordinator.hooks.forms import HookForm, HookSignatureError, read_reward
from coordinator.rewards.math_grading import extract_boxed, extract_last_number
from coordinator.rewards.rules import (
    REMOTE_RM,
    RULES,
    RewardError,
    apply_rule,
    base_rule,
    rm_type_names,
)
from coordinator.rollout.remote_rm import RemoteReward
from replay.sample import Reward, Sample, SampleStatus
from workers.hook_loading import load_object

__all__ = ["BUILTIN_RM_TYPES", "RewardError", "RewardModel", "extract_boxed", "extract_last_number",
           "rm_type_names"]

#: The built-in reward types by name (the registry itself lives in `reward_rules`).
BUILTIN_RM_TYPES = RULES


# ------------------------------------------------------------------------------------------------- router


def _where(sample: Sample) -> str:
    return f"sample {sample.group_index}/{sample.sample_index}"


def _is_async_callable(fn: object) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))  # noqa: B004


class RewardModel:
    """Scores groups of samples with a built-in rm type or a custom function (custom wins when both are set).

    Args:
        rm_type: a built-in reward type (`reward_rules.rm_type_names()`).
        custom_rm_path / custom_rm: a custom rm by hook path, or the function itself (tests, programmatic use).
        group_rm: the custom rm scores a whole group at once.
        reward_key: the entry of a dict reward that advantages (or eval metrics) use.
        rm_url: the reward service of `remote_rm` (`--rm-url`).
        remote: the `RemoteReward` to use instead of one built from `rm_url` (tests: short deadlines).
    """

    def __init__(
        self,
        *,
        rm_type: str | None = None,
        custom_rm_path: str | None = None,
        group_rm: bool = False,
        reward_key: str | None = None,
        custom_rm: Callable[..., object] | None = None,
        rm_url: str | None = None,
        remote: RemoteReward | None = None,
        args: argparse.Namespace | None = None,
    ) -> None:
        self.rm_type = rm_type
        self.args = args
        self._slime_form = False
        self.group_rm = group_rm
        self.reward_key = reward_key
        self.rm_url = rm_url
        self._remote = remote if remote is not None else RemoteReward(rm_url) if rm_url else None
        #: samples whose custom rm escaped (exit, interrupt, its own cancellation): FAILED with reward 0.0
        self.failed = 0
        self._custom: Callable[..., Any] | None = custom_rm
        self._custom_name = getattr(custom_rm, "__qualname__", repr(custom_rm)) if custom_rm else ""
        if self._custom is None and custom_rm_path:
            self._custom = load_object(custom_rm_path, what="--custom-rm-path")
            self._custom_name = custom_rm_path
        if self._custom is not None:
            if not callable(self._custom):
                raise RewardError(f"--custom-rm-path {self._custom_name!r} is not callable")
            self._custom_is_async = _is_async_callable(self._custom)
            try:
                reading = read_reward("--custom-rm-path", self._custom_name, self._custom, group_rm=group_rm)
            except HookSignatureError as error:
                raise RewardError(str(error)) from None
            self._slime_form = reading.form is HookForm.SLIME
        elif rm_type:
            self._rule_of(rm_type, "--rm-type")
        else:
            raise RewardError("no reward function: set --rm-type or --custom-rm-path")

    def _rule_of(self, rm_type: str, where: str) -> str:
        """`rm_type`, checked: a known type, and `remote_rm` only with a reward service to ask."""
        try:
            rule, _ = base_rule(rm_type)
        except RewardError as error:
            raise RewardError(f"{where}: {error} (or pass --custom-rm-path)") from None
        if rule.name == REMOTE_RM and self._remote is None:
            raise RewardError(f"{where}: rm-type remote_rm needs --rm-url (the reward service to POST to)")
        return rm_type

    def _sample_rm_type(self, sample: Sample) -> str:
        """slime's order: the sample's `metadata["rm_type"]` (an eval dataset's, or a data row's), then
        `--rm-type`."""
        own = (sample.metadata or {}).get("rm_type")
        if isinstance(own, str) and own.strip():
            return self._rule_of(own.strip(), f"metadata rm_type of {_where(sample)}")
        assert self.rm_type is not None
        return self.rm_type

    def _check(self, value: object, sample: Sample, source: str | None = None) -> Reward:
        if type(value) is float and math.isfinite(value):  # the common case, without the ABC checks below
            return value
        if source is None:
            source = f"--custom-rm-path {self._custom_name!r}" if self._custom is not None else (
                f"--rm-type {self.rm_type}")
        if isinstance(value, bool):
            value = float(value)
        if isinstance(value, numbers.Real):
            reward = float(value)
            if not math.isfinite(reward):
                raise RewardError(f"{source} returned {reward} for {_where(sample)}; rewards must be finite")
            return reward
        if isinstance(value, dict):
            return self._check_dict(value, sample, source)
        raise RewardError(
            f"{source} returned {type(value).__name__} ({value!r:.80}) for {_where(sample)}; "
            "expected a float or a dict[str, float]"
        )

    def _check_dict(self, value: dict[object, object], sample: Sample, source: str) -> dict[str, float]:
        checked: dict[str, float] = {}
        if self._slime_form and source.startswith("--custom-rm-path"):
            # slime's rms return extras beside the score (retool: `acc` a bool, `pred` the answer text).
            info = {key: item for key, item in value.items() if isinstance(key, str)
                    and not isinstance(item, numbers.Real) and key != self.reward_key}
            if info:
                sample.metadata["reward_info"] = info
            value = {key: float(item) if isinstance(item, bool) else item for key, item in value.items()
                     if key not in info}
        for key, item in value.items():
            if not isinstance(key, str) or isinstance(item, bool) or not isinstance(item, numbers.Real):
                raise RewardError(
                    f"{source} returned a dict with entry {key!r}: {item!r} for {_where(sample)}; "
                    "a dict reward must map str to float"
                )
            if not math.isfinite(float(item)):
                raise RewardError(f"{source} returned {key!r}: {item} for {_where(sample)}; rewards must be finite")
            checked[key] = float(item)
        if self.reward_key is None:
            raise RewardError(
                f"{source} returned a dict reward ({sorted(checked)}) for {_where(sample)}; "
                "pass --reward-key to choose the entry used for advantages"
            )
        if self.reward_key not in checked:
            raise RewardError(
                f"--reward-key {self.reward_key!r} is not in the reward {source} returned for "
                f"{_where(sample)} (keys: {sorted(checked)})"
            )
        return checked

    async def _score_builtin(self, samples: Sequence[Sample]) -> None:
        remote: list[tuple[Sample, str]] = []
        for sample in samples:
            rm_type = self._sample_rm_type(sample)
            rule, _ = base_rule(rm_type)
            if rule.name == REMOTE_RM:
                remote.append((sample, rm_type))
                continue
            if rule.needs_label and sample.label is None:
                raise RewardError(
                    f"--rm-type {rm_type} needs a label but {_where(sample)} has none (set --label-key)"
                )
            try:
                value = apply_rule(rm_type, sample)
            except RewardError as error:
                raise RewardError(f"{error} ({_where(sample)})") from None
            sample.reward = value if type(value) is float and math.isfinite(value) else self._check(
                value, sample, f"--rm-type {rm_type}")
        if remote:
            assert self._remote is not None  # _rule_of refuses remote_rm without one
            values = await self._remote.score([sample for sample, _ in remote])
            for (sample, _), value in zip(remote, values, strict=True):
                sample.reward = self._check(value, sample, f"--rm-url {self._remote.url}")

    async def _call_custom(self, subject: Any, samples: Sequence[Sample]) -> tuple[bool, Any]:
        """(True, the custom rm's value), or (False, None) when it escaped: `samples` then failed (FAILED, 0.0)."""
        assert self._custom is not None
        args = (self.args, subject) if self._slime_form else (subject,)
        what = f"--custom-rm-path {self._custom_name!r}"
        try:
            return True, await call_hook(self._custom, *args, what=what, kind="reward")
        except HookEscaped as escaped:
            log_escape(escaped, f"{', '.join(_where(sample) for sample in samples)} failed (status failed, "
                                "reward 0.0)")
            for sample in samples:
                sample.status = SampleStatus.FAILED
                sample.reward = 0.0
            self.failed += len(samples)
            return False, None

    async def _score_custom_one(self, sample: Sample) -> None:
        scored, value = await self._call_custom(sample, [sample])
        if scored:
            sample.reward = self._check(value, sample)

    async def _score_custom_group(self, samples: Sequence[Sample]) -> None:
        scored, values = await self._call_custom(list(samples), samples)
        if not scored:
            return
        if not isinstance(values, (list, tuple)):
            raise RewardError(
                f"--custom-rm-path {self._custom_name!r} with --group-rm returned {type(values).__name__}; "
                f"expected a list of {len(samples)} rewards"
            )
        if len(values) != len(samples):
            raise RewardError(
                f"--custom-rm-path {self._custom_name!r} with --group-rm returned {len(values)} rewards "
                f"for a group of {len(samples)} samples"
            )
        checked = [self._check(value, sample) for value, sample in zip(values, samples, strict=True)]
        for sample, reward in zip(samples, checked, strict=True):
            sample.reward = reward

    async def score_group(self, samples: list[Sample], *, keep_given: bool = False) -> None:
        """Set `reward` on every sample of one prompt group (aborted and failed samples get 0.0 unscored).
        `keep_given`: a sample that already has a reward keeps it, checked (a custom generate function set it,
        as slime allows)."""
        unscored = (SampleStatus.ABORTED, SampleStatus.FAILED)
        scored = []
        for sample in samples:
            if keep_given and sample.reward is not None:
                sample.reward = self._check(sample.reward, sample, "the custom generate function")
            elif sample.status in unscored:
                sample.reward = 0.0
            else:
                scored.append(sample)
        if not scored:
            return
        if self._custom is None:
            await self._score_builtin(scored)
        elif self.group_rm:
            await self._score_custom_group(scored)
        elif self._custom_is_async:
            async with anyio.create_task_group() as task_group:
                for sample in scored:
                    task_group.start_soon(self._score_custom_one, sample)
        else:
            for sample in scored:
                await self._score_custom_one(sample)
