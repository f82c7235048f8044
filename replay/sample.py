"""The Sample record: one generated (or replayed) response and everything training needs from it.

Owned here, in `replay/`, because both the coordinator and the dump format need it, and `replay` imports
neither `coordinator` nor `workers`. slime's `Sample` in shape (field names, `Sample.Status`,
`append_response_tokens`, `get_reward_value`, attributes a hook adds), plus `sample_index` and `advantage`;
multi-turn samples and slime's alignment: docs/replay.md.

Invariant kept by `Sample.validate()`: `tokens` holds prompt + response, the response is the last
`response_length` tokens, and `loss_mask` / `rollout_log_probs` are lists with exactly `response_length`
entries (slime's `None` is resolved by `settle_hook_fields` when a hook hands a sample back); so has
`teacher_log_probs` when it is set (on-policy distillation).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import argparse

    from workers.boundary.json_input import JsonObject, JsonValue


Reward = float | dict[str, float] | None


class SampleStatus(str, enum.Enum):
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    #: slime's: a recoverable failure (a tool or an external service failed); not scored, reward 0.
    FAILED = "failed"


#: SGLang's `meta_info.finish_reason.type` → the status it gives a sample (slime's mapping).
FINISH_STATUS: dict[str, SampleStatus] = {
    "stop": SampleStatus.COMPLETED,
    "length": SampleStatus.TRUNCATED,
    "abort": SampleStatus.ABORTED,
}


class SampleError(ValueError):
    """A sample whose fields contradict each other."""


def label_value(value: JsonValue, *, where: str, key: str) -> JsonValue:
    """The label as the data file holds it, its JSON type kept, as slime's `Sample.label = data[label_key]`:
    text, a number (a choice index to `gpqa`, a number to `math`), a list or an object (several accepted
    answers, test cases, Search-R1's `reward_model`), or null. A boolean is refused (a data mistake more often
    than a label; no built-in reward type reads one). One exception to the type: an integer beyond 64 bits
    becomes its decimal text, since a rollout dump (msgpack) cannot hold it and the graders that read such a
    number (the math family) read it as text. A run's prompt source (`coordinator.data.source`) and `rayless reward
    score` both read labels through this, so the score command grades what a run grades."""
    if value is None or isinstance(value, str):
        return value
    if type(value) is int and not -(2**63) <= value < 2**64:
        return str(value)
    if isinstance(value, bool):
        raise SampleError(
            f"{where}: label key {key!r} holds a boolean ({value!r}); expected text, a number, a list or an object"
        )
    if isinstance(value, (int, float, list, dict)):
        return value
    raise SampleError(
        f"{where}: label key {key!r} holds {type(value).__name__}; expected text, a number, a list or an object"
    )


@dataclass
class Sample:
    group_index: int = 0
    sample_index: int = 0
    #: Text; or chat messages / any JSON value a custom generate function reads (slime keeps the raw value).
    prompt: Any = ""
    tokens: list[int] = field(default_factory=list)
    response_length: int = 0
    loss_mask: list[int] = field(default_factory=list)
    rollout_log_probs: list[float] = field(default_factory=list)
    reward: Reward = None
    status: SampleStatus = SampleStatus.PENDING
    weight_versions: list[str] = field(default_factory=list)
    #: Text, or the JSON value of the data file (a dict of accepted answers, test cases, ...).
    label: Any = None
    response: str = ""
    advantage: float = 0.0
    metadata: dict[str, Any] = field(default_factory=dict)
    #: slime's `index`: the sample's position in its rollout (group_index × n_samples_per_prompt + sample_index).
    index: int | None = None
    #: slime's: on-policy distillation's teacher logprob of each response token (None: not distilled).
    teacher_log_probs: list[float] | None = None
    #: miles': top-k on-policy distillation's weighted reverse KL of each response token (None: not top-k OPD).
    opd_reverse_kl: list[float] | None = None
    #: slime's: the raw media of a vision-language prompt, `{"images": [PIL images]}` (None: text only)
    multimodal_inputs: dict[str, Any] | None = None
    #: slime's: the processor's outputs the trainer takes, `{"pixel_values", "image_grid_thw"}` (tensors)
    multimodal_train_inputs: dict[str, Any] | None = None

    #: slime's name for the enum: `Sample.Status.COMPLETED`.
    Status: ClassVar[type[SampleStatus]] = SampleStatus

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def response_tokens(self) -> list[int]:
        return self.tokens[self.prompt_length :]

    @property
    def effective_response_length(self) -> int:
        """slime's: the trained tokens (the loss mask's sum), tool output excluded."""
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length

    @property
    def is_multi_turn(self) -> bool:
        """True when some response tokens are not the model's (a tool's or the environment's output)."""
        return any(value == 0 for value in (self.loss_mask or ()))

    def scalar_reward(self, reward_key: str | None = None) -> float:
        """The reward used for advantages: the float itself, or `reward[reward_key]` for dict rewards."""
        if self.reward is None:
            raise SampleError(f"sample {self.group_index}/{self.sample_index} has no reward yet")
        if isinstance(self.reward, dict):
            if reward_key is None:
                raise SampleError(
                    f"sample {self.group_index}/{self.sample_index} has a dict reward "
                    f"({sorted(self.reward)}); pass --reward-key to choose one"
                )
            if reward_key not in self.reward:
                raise SampleError(
                    f"--reward-key {reward_key!r} is not in the reward of sample "
                    f"{self.group_index}/{self.sample_index} (keys: {sorted(self.reward)})"
                )
            return float(self.reward[reward_key])
        return float(self.reward)

    def get_reward_value(self, args: argparse.Namespace) -> Reward:
        """slime's: `reward`, or `reward[args.reward_key]` when `--reward-key` is set."""
        key = getattr(args, "reward_key", None)
        return self.reward if not key else self.reward[key]  # type: ignore[index]

    def append_response_tokens(
        self,
        args: Any = None,
        *,
        tokens: Any = None,
        log_probs: Any = None,
        trainable: bool = True,
        meta_info: JsonObject | None = None,
        text: str | None = None,
        update_terminal_info: bool = True,
    ) -> None:
        """Append response tokens keeping `loss_mask` and `rollout_log_probs` aligned (slime's method).

        The model's tokens: `trainable=True` with their logprobs (and the engine's `meta_info`, whose
        finish reason sets `status` and whose weight version is recorded). A tool's tokens: `trainable=False`,
        no logprobs: loss mask 0, logprob 0.0.
        """
        tokens = [int(token) for token in (tokens if tokens is not None else ())]
        log_probs = None if log_probs is None else [float(value) for value in log_probs]
        if log_probs is not None and len(log_probs) != len(tokens):
            raise SampleError(f"log_probs has {len(log_probs)} entries for {len(tokens)} tokens")
        if tokens and trainable and log_probs is None:
            raise SampleError("trainable response tokens need their rollout logprobs (return_logprob)")
        if tokens and not trainable:
            if log_probs is not None:
                raise SampleError("a tool's (non-trainable) tokens take no rollout logprobs")
            log_probs = [0.0] * len(tokens)
        if text is not None:
            self.response += text
        previous = self.response_length
        if self.loss_mask is None:
            self.loss_mask = [1] * previous
        if self.rollout_log_probs is None:
            if tokens and trainable and previous:
                raise SampleError("cannot append trainable logprobs to a response that has tokens but no "
                                  "rollout_log_probs")
            self.rollout_log_probs = [0.0] * previous
        self.tokens = [*self.tokens, *tokens]
        self.response_length += len(tokens)
        self.loss_mask = [*self.loss_mask, *([1 if trainable else 0] * len(tokens))]
        self.rollout_log_probs = [*self.rollout_log_probs, *(log_probs or [])]
        if meta_info and update_terminal_info and "finish_reason" in meta_info:
            self.apply_meta_info(meta_info)
        if len(self.loss_mask) != self.response_length:
            raise SampleError(f"loss_mask has {len(self.loss_mask)} entries, response_length is "
                              f"{self.response_length}")

    def apply_meta_info(self, meta_info: JsonObject) -> None:
        """The status from SGLang's finish reason and the weight version that answered (slime's rules)."""
        if "weight_version" in meta_info:
            version = str(meta_info["weight_version"])
            if not self.weight_versions or self.weight_versions[-1] != version:
                self.weight_versions = [*self.weight_versions, version]
        finish = meta_info.get("finish_reason")
        kind = finish.get("type") if isinstance(finish, dict) else None
        if kind in FINISH_STATUS:
            self.status = FINISH_STATUS[kind]

    def to_dict(self) -> dict[str, Any]:
        """slime's: every field and every attribute a hook added, the status as its value."""
        value = dict(self.__dict__)
        value["status"] = self.status.value if isinstance(self.status, SampleStatus) else self.status
        return value

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Sample:
        """slime's: known fields set by name, any other key becomes an attribute."""
        data = dict(data)
        if "status" in data:
            data["status"] = SampleStatus(data["status"])
        names = {f.name for f in fields(Sample)}
        sample = Sample(**{k: v for k, v in data.items() if k in names})
        for key, value in data.items():
            if key not in names:
                setattr(sample, key, value)
        return sample

    def extra_attributes(self) -> dict[str, Any]:
        """Attributes a hook added that are not fields (`tool_call_count`, ...)."""
        names = {f.name for f in fields(Sample)}
        return {key: value for key, value in self.__dict__.items() if key not in names}

    def validate(self) -> None:
        where = f"sample {self.group_index}/{self.sample_index}"
        for name in ("loss_mask", "rollout_log_probs", "tokens"):
            if not isinstance(getattr(self, name), list):
                raise SampleError(f"{where}: {name} must be a list, got {type(getattr(self, name)).__name__}")
        if self.response_length < 0 or self.response_length > len(self.tokens):
            raise SampleError(
                f"{where}: response_length {self.response_length} outside 0..{len(self.tokens)} tokens"
            )
        if len(self.loss_mask) != self.response_length:
            raise SampleError(
                f"{where}: loss_mask has {len(self.loss_mask)} entries, response_length is {self.response_length}"
            )
        if len(self.rollout_log_probs) != self.response_length:
            raise SampleError(
                f"{where}: rollout_log_probs has {len(self.rollout_log_probs)} entries, "
                f"response_length is {self.response_length}"
            )
        if not isinstance(self.status, SampleStatus):
            raise SampleError(f"{where}: status {self.status!r} is not a SampleStatus")
        teacher = self.teacher_log_probs
        if teacher is not None and (not isinstance(teacher, list) or len(teacher) != self.response_length):
            count = len(teacher) if isinstance(teacher, list) else type(teacher).__name__
            raise SampleError(f"{where}: teacher_log_probs has {count} entries, response_length is "
                              f"{self.response_length}")
        reverse_kl = self.opd_reverse_kl
        if reverse_kl is not None and (not isinstance(reverse_kl, list) or len(reverse_kl) != self.response_length):
            count = len(reverse_kl) if isinstance(reverse_kl, list) else type(reverse_kl).__name__
            raise SampleError(f"{where}: opd_reverse_kl has {count} entries, response_length is "
                              f"{self.response_length}")


def settle_hook_fields(sample: Sample, *, where: str) -> None:
    """A sample a slime-style hook handed back, in our invariant: slime's `loss_mask=None` (all ones) and
    `rollout_log_probs=None` with no response become lists; a slime `Status` of another enum class becomes
    ours by value; anything else that contradicts itself is a SampleError naming `where` (the hook)."""
    status = sample.status
    if not isinstance(status, SampleStatus):
        value = getattr(status, "value", status)
        try:
            sample.status = SampleStatus(value)
        except ValueError:
            raise SampleError(f"{where}: status {status!r} is not one of "
                              f"{[s.value for s in SampleStatus]}") from None
    if sample.tokens is None or not isinstance(sample.response_length, int):
        raise SampleError(f"{where}: the sample needs `tokens` (prompt + response ids) and an int "
                          f"`response_length`")
    sample.tokens = [int(token) for token in sample.tokens]
    if sample.loss_mask is None:
        sample.loss_mask = [1] * sample.response_length
    if sample.rollout_log_probs is None:
        if sample.response_length and sample.status is not SampleStatus.ABORTED:
            raise SampleError(f"{where}: the sample has {sample.response_length} response tokens but no "
                              "rollout_log_probs; post with \"return_logprob\": true and keep the engine's "
                              "meta_info.output_token_logprobs (0.0 on tool tokens)")
        sample.rollout_log_probs = [0.0] * sample.response_length
    sample.loss_mask = [int(value) for value in sample.loss_mask]
    sample.rollout_log_probs = [float(value) for value in sample.rollout_log_probs]
    try:
        sample.validate()
    except SampleError as error:
        raise SampleError(f"{where}: {error}") from None
    bad = [i for i, (mask, value) in enumerate(zip(sample.loss_mask, sample.rollout_log_probs, strict=True))
           if mask and not math.isfinite(value)]
    if bad:
        raise SampleError(f"{where}: rollout logprob {sample.rollout_log_probs[bad[0]]} at response token "
                          f"{bad[0]} (a trained token) is not finite")


@dataclass
class RolloutBatch:
    """What a data source hands the training loop for one rollout id: groups of samples plus metrics."""

    rollout_id: int
    groups: list[list[Sample]]
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def samples(self) -> list[Sample]:
        return [sample for group in self.groups for sample in group]
