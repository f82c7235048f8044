"""Which calling convention a hook has — rayless' own or slime's (miles' where noted) — read from its signature.

Owns the one reading of hook signatures, shared by the start-up check (`coordinator.checks.preflight`) and
the code that calls the hooks (rewards, filters, the rollout, the trainer's TIS hook), so a hook is called
exactly the way start-up accepted it:

| flag | rayless | slime |
|---|---|---|
| `--custom-rm-path` | `fn(sample)`; `fn(samples)` with `--group-rm` | `fn(args, sample, **kw)`; `fn(args, samples, **kw)` |
| `--dynamic-sampling-filter-path` | `fn(group[, reward_key=])` | `fn(args, samples, **kw)` |
| `--rollout-function-path`, `--eval-function-path` | class `C(context)` called `(rollout_id, weight_version)`, or `fn(context, rollout_id, weight_version)` | `fn(args, rollout_id, data_source, evaluation=False)`; miles' class `C(RolloutFnConstructorInput)` called `(input)` |
| `--custom-generate-function-path` | — | `fn(args, sample, sampling_params[, evaluation])`; miles' `fn(input)` |
| `--generate-execute-tool-function-path` | — | miles' `fn(name, params) -> str` |
| `--custom-tis-function-path` | — | `fn(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths, **kw)` |

The two forms of one flag are told apart by what the signature binds; where both bind, a first parameter
named `args` (or a `data_source` parameter, for rollout functions) means slime's. Invariant: a signature
that binds neither form raises `HookSignatureError` saying how rayless would call it and what it got.
"""

from __future__ import annotations

import enum
import inspect
from dataclasses import dataclass
from typing import Any


class HookForm(str, enum.Enum):
    RAYLESS = "rayless"
    SLIME = "slime"
    MILES = "miles"


class HookSignatureError(ValueError):
    """A hook whose signature accepts none of the calls rayless makes for its flag."""


@dataclass(frozen=True)
class Reading:
    form: HookForm
    #: How rayless calls it, for messages and `--dry-run` notes.
    shown: str
    #: slime's generate functions: whether `evaluation=` is passed.
    passes_evaluation: bool = False


def _signature(target: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(target)
    except (TypeError, ValueError):  # builtins and some C callables have none: nothing to check against
        return None


def _binds(signature: inspect.Signature | None, *args: str, **kwargs: str) -> bool:
    if signature is None:
        return True
    try:
        signature.bind(*args, **kwargs)
    except TypeError:
        return False
    return True


def _first_is_args(signature: inspect.Signature | None) -> bool:
    if signature is None:
        return False
    params = list(signature.parameters.values())
    return bool(params) and params[0].name == "args"


def _refuse(flag: str, path: str, signature: inspect.Signature | None, *calls: str) -> HookSignatureError:
    return HookSignatureError(f"{flag} {path!r}: rayless calls it as {' or as '.join(calls)}, but its signature "
                              f"is {signature}")


def read_reward(flag: str, path: str, target: Any, *, group_rm: bool) -> Reading:
    signature = _signature(target)
    one = "samples" if group_rm else "sample"
    name = getattr(target, "__name__", "fn")
    ours, theirs = f"{name}({one})", f"{name}(args, {one}, **kwargs)"
    slime_ok = _binds(signature, "args", one)
    if slime_ok and (_first_is_args(signature) or not _binds(signature, one)):
        return Reading(HookForm.SLIME, theirs + " (slime's form)")
    if _binds(signature, one):
        return Reading(HookForm.RAYLESS, ours)
    raise _refuse(flag, path, signature, ours, theirs + " (slime's form)")


def read_filter(flag: str, path: str, target: Any) -> Reading:
    signature = _signature(target)
    name = getattr(target, "__name__", "fn")
    ours, theirs = f"{name}(group)", f"{name}(args, samples, **kwargs)"
    slime_ok = _binds(signature, "args", "samples")
    if slime_ok and (_first_is_args(signature) or not _binds(signature, "group")):
        return Reading(HookForm.SLIME, theirs + " (slime's form)")
    if _binds(signature, "group"):
        return Reading(HookForm.RAYLESS, ours + " (reward_key= too, when it accepts it)")
    raise _refuse(flag, path, signature, ours, theirs + " (slime's form)")


def read_reward_post_process(flag: str, path: str, target: Any) -> Reading:
    """slime's `_post_process_rewards` hook: `fn(args, samples) -> (raw_rewards, rewards)`."""
    signature = _signature(target)
    theirs = f"{getattr(target, '__name__', 'fn')}(args, samples) -> (raw_rewards, rewards)"
    if _binds(signature, "args", "samples"):
        return Reading(HookForm.SLIME, theirs + " (slime's form)")
    raise _refuse(flag, path, signature, theirs + " (slime's form)")


def read_rollout_fn(flag: str, path: str, target: Any) -> Reading:
    """Functions only (a class is rayless' form; `preflight` checks its constructor and `__call__`)."""
    signature = _signature(target)
    name = getattr(target, "__name__", "fn")
    ours = f"{name}(context, rollout_id, weight_version)"
    theirs = f"{name}(args, rollout_id, data_source, evaluation=...)"
    has_data_source = signature is not None and "data_source" in signature.parameters
    if _binds(signature, "args", "rollout_id", "data_source") and (has_data_source or _first_is_args(signature)):
        return Reading(HookForm.SLIME, theirs + " (slime's form)")
    if _binds(signature, "context", "rollout_id", "weight_version"):
        return Reading(HookForm.RAYLESS, ours)
    raise _refuse(flag, path, signature, ours, theirs + " (slime's form)")


def class_call(target: type) -> Any:
    """The instances' `__call__` as the class defines it (getattr on a class would give type.__call__)."""
    return next((klass.__dict__["__call__"] for klass in target.__mro__[:-1] if "__call__" in klass.__dict__),
                None)


def read_rollout_class(flag: str, path: str, target: type) -> Reading:
    """A class: miles' form (`C(RolloutFnConstructorInput(args, data_source))`, instances called with one
    `RolloutFnTrainInput` / `RolloutFnEvalInput`) or rayless' (`C(context)`, called `(rollout_id,
    weight_version)`). Where both bind, a parameter named `input` means miles'."""
    name = target.__name__
    call = class_call(target)
    if call is None:
        raise HookSignatureError(f"{flag} {path!r}: instances of class {name} are not callable: define "
                                 "__call__(self, input) (miles' form) or __call__(self, rollout_id, weight_version)")
    init, signature = _signature(target), _signature(call)
    miles = f"{name}(RolloutFnConstructorInput(args, data_source)), called as instance(RolloutFnTrainInput | " \
            "RolloutFnEvalInput)"
    ours = f"{name}(context), called as instance(rollout_id, weight_version)"
    params = list(signature.parameters.values())[1:] if signature is not None else []
    named_input = bool(params) and params[0].name == "input"
    if _binds(init, "input") and _binds(signature, "self", "input") and (
            named_input or not _binds(signature, "self", "rollout_id", "weight_version")):
        asynchronous = inspect.iscoroutinefunction(call)
        return Reading(HookForm.MILES, f"class, built as {miles} ({'async' if asynchronous else 'sync'} "
                                       "__call__; miles' form)")
    if _binds(init, "context") and _binds(signature, "self", "rollout_id", "weight_version"):
        return Reading(HookForm.RAYLESS, f"class, built as {ours}")
    raise HookSignatureError(f"{flag} {path!r}: rayless builds a class as {ours}, or in miles' form as {miles}, "
                             f"but {name}{init} has __call__{signature}")


def read_generate(flag: str, path: str, target: Any) -> Reading:
    signature = _signature(target)
    name = getattr(target, "__name__", "fn")
    if not (inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(getattr(target, "__call__", None))):  # noqa: B004
        raise HookSignatureError(f"{flag} {path!r}: must be an async function (slime awaits it), got "
                                 f"{type(target).__name__} {name}")
    params = list(signature.parameters.values()) if signature is not None else []
    if len(params) == 1 and params[0].name == "input":
        return Reading(HookForm.MILES, f"await {name}(input) (miles' GenerateFnInput form)")
    evaluation = signature is not None and "evaluation" in signature.parameters
    if _binds(signature, "args", "sample", "sampling_params"):
        shown = f"await {name}(args, sample, sampling_params{', evaluation=...' if evaluation else ''})"
        return Reading(HookForm.SLIME, shown, passes_evaluation=evaluation)
    raise _refuse(flag, path, signature, f"await {name}(args, sample, sampling_params[, evaluation=...])",
                  f"await {name}(input) (miles' form)")


def read_execute_tool(flag: str, path: str, target: Any) -> Reading:
    signature = _signature(target)
    name = getattr(target, "__name__", "fn")
    if not inspect.iscoroutinefunction(target):
        raise HookSignatureError(f"{flag} {path!r}: must be an async function (miles awaits it)")
    if _binds(signature, "name", "params"):
        return Reading(HookForm.MILES, f"await {name}(name, params) -> str")
    raise _refuse(flag, path, signature, f"await {name}(name, params)")


TIS_KEYWORDS = ("pg_loss", "train_log_probs", "rollout_log_probs", "loss_masks", "total_lengths",
                "response_lengths")


def read_tis(flag: str, path: str, target: Any) -> Reading:
    signature = _signature(target)
    name = getattr(target, "__name__", "fn")
    shown = f"{name}(args, *, {', '.join(TIS_KEYWORDS)}) -> (pg_loss, loss_masks, metrics)"
    if _binds(signature, "args", **{key: key for key in TIS_KEYWORDS}):
        return Reading(HookForm.SLIME, shown + " (slime's form)")
    raise _refuse(flag, path, signature, shown)


def check_tool_specs(flag: str, path: str, target: Any) -> str:
    """miles' tool specs: a list of OpenAI function tools, each `{"type": "function", "function": {"name": ...}}`."""
    if not isinstance(target, list) or not target:
        raise HookSignatureError(f"{flag} {path!r}: expected a non-empty list of tool specs, got "
                                 f"{type(target).__name__}")
    names = []
    for position, spec in enumerate(target):
        function = spec.get("function") if isinstance(spec, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise HookSignatureError(f"{flag} {path!r}: tool spec {position} is not "
                                     "{'type': 'function', 'function': {'name': ..., 'parameters': ...}}")
        names.append(function["name"])
    return f"{len(names)} tool(s): {', '.join(names)}"
