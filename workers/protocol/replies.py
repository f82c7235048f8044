"""The ranks' replies on the control channel: one record per command, declared once for both sides.

Owns `Reply` (the tagged union a `Response.result` holds: its `kind` names the command it answers), each
command's reply record, and the records inside them (`StepMetrics`, the tensor metadata `TensorMeta`). The
rank's handlers return these records; the coordinator decodes them with the family's typed decoder and reads
fields, never keys.

Invariants: every command kind has exactly one reply kind of the same name (`REPLY_KINDS` is checked against
the commands by the tests); a reply field without a default is required on the wire; only rank 0's reply is
read where only rank 0 acts (the other ranks answer the record's defaults). Imports no torch.
"""

from __future__ import annotations

from typing import Any

import msgspec

from workers.protocol.messages import Record, TaggedRecord, kinds, union_of

#: one tensor as a weight update announces it: (name, dtype name, shape)
TensorMeta = tuple[str, str, list[int]]


class Reply(TaggedRecord):
    """The base of the replies (abstract: no `tag`). A reply's `kind` is the kind of the command it answers."""


class StepMetrics(Record):
    """One rank's raw numbers for one optimizer step (`TrainResult.steps`).

    The first eight are sums over this rank's tokens (the losses already divided by the step's loss tokens
    over all ranks), so the ranks' values add up; `logprob_abs_diff_max` is this rank's maximum; `grad_norm`
    and `lr` are the same on every rank (gradients are all-reduced before clipping); `step_time_s` is this
    rank's wall time. `coordinator.train.planning.reduce_step_metrics` combines them into a step's metrics.
    """

    loss: float
    pg_loss: float
    loss_tokens: float
    clipped_tokens: float
    entropy_sum: float
    kl_sum: float
    logprob_abs_diff_sum: float
    num_tokens: float
    logprob_abs_diff_max: float
    grad_norm: float
    lr: float
    step_time_s: float
    # With --use-tis: the sum of the TIS weights over loss tokens, and the tokens whose weight was clamped.
    tis_sum: float = 0.0
    tis_clipped_tokens: float = 0.0
    # Sums over loss tokens of the metrics a `--custom-tis-function-path` hook returned, by its names.
    extra: dict[str, float] = msgspec.field(default_factory=dict)


class InitReply(Reply, tag="init"):
    """The model a rank loaded: its parameters (all, and those the optimizer trains) and its device."""

    num_parameters: int
    trainable_parameters: int
    device: str


class TrainResult(Reply, tag="train"):
    """A rank's answer to `TrainCommand`: one `StepMetrics` per optimizer step, in order."""

    steps: list[StepMetrics]


class SaveReply(Reply, tag="save"):
    """Where the checkpoint was written (`rollout_<id>`, or `tmp-<id>` until published)."""

    path: str


class PublishReply(Reply, tag="publish"):
    """Rank 0: the published checkpoint's directory (the other ranks answer an empty `path`)."""

    path: str = ""


class SaveHfReply(Reply, tag="save_hf"):
    """Rank 0: the Hugging Face directory written (the other ranks answer an empty `path`)."""

    path: str = ""


class LoadReply(Reply, tag="load"):
    """The checkpoint a rank restored: the rollout it was saved at, the coordinator's `extra` saved with it
    (the rollout source's state, ...), and its directory."""

    rollout_id: int
    extra: dict[str, Any]
    path: str


class ExportWeightsReply(Reply, tag="export_weights"):
    """Rank 0: the snapshot directory written and its tensors (the other ranks answer the defaults); with
    `--update-weight-mode delta`, whether it is a delta and the names of the tensors it holds."""

    path: str = ""
    manifest: list[TensorMeta] = msgspec.field(default_factory=list)
    delta: bool = False
    changed: list[str] = msgspec.field(default_factory=list)


class WeightManifestReply(Reply, tag="weight_manifest"):
    """Per bucket, the tensors in send order (what `broadcast_weights` with the same bucket size sends)."""

    buckets: list[list[TensorMeta]]

    @property
    def manifest(self) -> list[TensorMeta]:
        """Every tensor of every bucket, in send order."""
        return [entry for bucket in self.buckets for entry in bucket]


class BroadcastWeightsReply(Reply, tag="broadcast_weights"):
    """Rank 0's report of one broadcast: whether it `joined` the group and sent every bucket (`ok`), what
    failed (`error`), and what it sent. A failure is reported here, not raised, so the training group stays
    usable; the other ranks answer the defaults."""

    ok: bool = False
    joined: bool = False
    error: str = ""
    buckets: int = 0
    bytes: int = 0
    seconds: float = 0.0


class DestroyWeightGroupReply(Reply, tag="destroy_weight_group"):
    """Whether rank 0 had the group and destroyed it (the other ranks answer False)."""

    destroyed: bool = False


class StateMoveReply(Reply):
    """One rank's offload or onload (abstract: the two kinds below): its seconds, the state's bytes, where
    memory stood (`memory`: every other figure, each in bytes: `rss_bytes`, `before_rss_bytes`, on CUDA the
    allocator's and the device's), and, when the command asked `verify`, a digest of the state's bytes."""

    seconds: float
    state_bytes: int
    memory: dict[str, int] = msgspec.field(default_factory=dict)
    digest: str | None = None

    @classmethod
    def of(cls, figures: dict[str, Any]) -> StateMoveReply:
        """The reply from `workers.train_rank.offload.StateOffload`'s figures."""
        memory = {key: int(value) for key, value in figures.items()
                  if key.endswith("_bytes") and key != "state_bytes"}
        return cls(seconds=float(figures["seconds"]), state_bytes=int(figures["state_bytes"]), memory=memory,
                   digest=figures.get("digest"))


class OffloadReply(StateMoveReply, tag="offload"):
    pass


class OnloadReply(StateMoveReply, tag="onload"):
    pass


class ShutdownReply(Reply, tag="shutdown"):
    """The rank exits after sending this."""


class ForwardBackwardReply(Reply, tag="forward_backward"):
    """The Tinker service's forward(/backward) on this rank's share of the data: per datum of the share, in
    order, the target tokens' logprobs and the loss at each position; `loss_sum` the share's loss; `seconds` the
    rank's own time for it."""

    logprobs: list[list[float]] = msgspec.field(default_factory=list)
    elementwise_loss: list[list[float]] = msgspec.field(default_factory=list)
    loss_sum: float = 0.0
    seconds: float = 0.0


class OptimStepReply(Reply, tag="optim_step"):
    """The gradient's global norm before clipping (the same on every rank); `seconds` the rank's own time."""

    grad_norm: float = 0.0
    seconds: float = 0.0


#: any reply (built from the declarations above: a new Reply subclass with a tag is one)
AnyReply = union_of(Reply)
#: every reply kind, by name (each the name of the command it answers)
REPLY_KINDS: dict[str, type[Reply]] = kinds(Reply)
