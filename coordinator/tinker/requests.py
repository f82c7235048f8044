"""The Tinker API's JSON request bodies, as the official SDK sends them, validated into typed records, and the
checks of a `forward_backward` batch before any rank sees it.

Owns the request records (msgspec structs: fields the service reads; others the SDK sends are ignored, as a
newer SDK may add some), `convert` (a body into its record, a 400 naming the field otherwise), `LOSSES` (the
built-in losses served and the inputs each needs) and `training_data` (the protobuf batch as the ranks' data).
Invariant: what reaches a rank has the shapes its loss needs; every refusal names the call, field or loss.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec
import numpy as np

from coordinator.tinker.wire import ForwardBackwardRequest
from workers import protocol
from workers.boundary.http_gates import HttpReply
from workers.boundary.json_input import JsonValue

#: the built-in losses the service computes, and the loss_fn_inputs each takes besides target_tokens
LOSSES: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("weights",),
    "importance_sampling": ("logprobs", "advantages"),
    "ppo": ("logprobs", "advantages"),
}
#: the SDK's other loss names (tinker.types.LossFnType), refused by name
OTHER_LOSSES = ("cispo", "dro", "gspo", "stable_reinforce", "custom")
PPO_CONFIG = ("clip_low_threshold", "clip_high_threshold")


class _Body(msgspec.Struct, forbid_unknown_fields=False):
    pass


class LoraConfig(_Body):
    rank: int
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfig(_Body):
    type: str = "adamw"


class CreateModel(_Body):
    session_id: str
    base_model: str
    model_seq_id: int = 0
    lora_config: LoraConfig | None = None
    optimizer_config: OptimizerConfig | None = None


class ModelRef(_Body):
    model_id: str
    seq_id: int | None = None


class AdamParams(_Body):
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


class OptimStep(_Body):
    model_id: str
    seq_id: int | None = None
    adam_params: AdamParams | None = None
    optimizer_params: dict[str, object] | None = None


class SaveWeights(_Body):
    model_id: str
    path: str | None = None
    seq_id: int | None = None
    sampling_session_seq_id: int | None = None


class LoadWeights(_Body):
    path: str
    optimizer: bool = False
    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: int | None = None
    base_model: str | None = None


class SessionRef(_Body):
    session_id: str


class CreateSamplingSession(_Body):
    session_id: str
    sampling_session_seq_id: int = 0
    base_model: str | None = None
    model_path: str | None = None


class Chunk(_Body):
    type: str = "encoded_text"
    tokens: list[int] = []


class ModelInput(_Body):
    chunks: list[Chunk]


class SamplingParams(_Body):
    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str | int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0


class Sample(_Body):
    prompt: ModelInput
    sampling_params: SamplingParams
    num_samples: int = 1
    sampling_session_id: str | None = None
    seq_id: int | None = None
    base_model: str | None = None
    model_path: str | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: object = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None
    record_stability_info: bool | None = None


class RetrieveFuture(_Body):
    request_id: str


B = TypeVar("B", bound=_Body)


def convert(value: JsonValue, kind: type[B], call: str) -> B:
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError as error:
        raise HttpReply(400, f"{call}: {error}") from None


def prompt_tokens(model_input: ModelInput, call: str, max_tokens: int) -> list[int]:
    tokens: list[int] = []
    for chunk in model_input.chunks:
        if chunk.type != "encoded_text":
            raise HttpReply(400, f"{call}: {chunk.type} chunks are not supported by this service (text only)")
        tokens.extend(chunk.tokens)
    if not tokens or len(tokens) > max_tokens:
        raise HttpReply(400, f"{call}: a prompt needs 1 to {max_tokens} tokens (--max-tokens), got {len(tokens)}")
    return tokens


def refuse_loss(loss_fn: str) -> None:
    if loss_fn in LOSSES:
        return
    if loss_fn in OTHER_LOSSES:
        raise HttpReply(400, f"forward_backward: loss_fn {loss_fn!r} is not served by rayless tinker-server "
                        f"(it serves {', '.join(LOSSES)})")
    raise HttpReply(400, f"forward_backward: unknown loss_fn {loss_fn!r} (this service serves "
                    f"{', '.join(LOSSES)})")


def training_data(request: ForwardBackwardRequest, vocab_size: int) -> list[protocol.TinkerDatum]:
    """The batch as the ranks take it, each datum checked against the inputs its loss needs."""
    needs = LOSSES[request.loss_fn]
    if not request.data:
        raise HttpReply(400, "forward_backward: no data")
    unknown = sorted(set(request.loss_config) - set(PPO_CONFIG if request.loss_fn == "ppo" else ()))
    if unknown:
        raise HttpReply(400, f"forward_backward: loss_fn_config keys {unknown} are not taken by {request.loss_fn!r}")
    if any(isinstance(v, str) for v in request.loss_config.values()):
        raise HttpReply(400, f"forward_backward: {request.loss_fn!r} takes numbers in loss_fn_config")
    data = []
    for index, datum in enumerate(request.data):
        where = f"forward_backward: data[{index}]"
        length = len(datum.tokens)
        if not length:
            raise HttpReply(400, f"{where}: an empty model_input")
        fields: dict[str, list[float]] = {}
        for name in ("target_tokens", *needs):
            array = datum.inputs.get(name)
            if array is None:
                raise HttpReply(400, f"{where}: {request.loss_fn!r} needs loss_fn_inputs[{name!r}]")
            if array.size != length:
                raise HttpReply(400, f"{where}: loss_fn_inputs[{name!r}] has {array.size} values for "
                                f"{length} model_input tokens")
            if name != "target_tokens" and not np.isfinite(array).all():
                raise HttpReply(400, f"{where}: loss_fn_inputs[{name!r}] is not finite")
            fields[name] = array.astype(np.float64).tolist()
        tokens = np.asarray(datum.tokens)
        targets = np.asarray(fields.pop("target_tokens"), dtype=np.int64)
        for name, ids in (("model_input", tokens), ("target_tokens", targets)):
            if ids.min() < 0 or ids.max() >= vocab_size:
                raise HttpReply(400, f"{where}: {name} has a token outside the vocabulary (0..{vocab_size - 1})")
        extra = sorted(set(datum.inputs) - {"target_tokens", *needs})
        if extra:
            raise HttpReply(400, f"{where}: {request.loss_fn!r} does not take loss_fn_inputs {extra}")
        data.append(protocol.TinkerDatum(tokens=datum.tokens, target_tokens=targets.tolist(), **fields))
    return data

