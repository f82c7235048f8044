"""The model runner: the Hugging Face causal LM, its tokenizer, and the batch KV cache of the running sequences.

Owns every tensor of the engine, all on one device (`cpu` or `cuda:N`): the model, the cache, and every index,
mask and position tensor a step makes are created there; logits are taken to float32 before any logprob.
Its methods are blocking and run in a worker thread (the scheduler calls them through `anyio.to_thread` while
holding its model lock), so only one of them runs at a time.

The batch cache holds one row per running sequence, left-padded to a common length: row r's real tokens fill
the last `length - pad[r]` columns. Every forward passes an attention mask that hides the padding and explicit
position ids (a row's position is its own token count), so a sequence decoded in a batch gets the same logits
as alone, within float rounding. A new sequence is prefilled on its own (no padding) and then merged in; rows
of finished sequences are removed and all-padding columns trimmed.

A vision-language model (Qwen2-VL / Qwen2.5-VL / Qwen3-VL, `workers.vlm_processor`) is served the same way: a
sequence with images is prefilled on its own with its `pixel_values` and the model's multimodal rotary positions
(from its `get_rope_index`), and keeps its rope delta, so its decode steps in the batch take position
`length + delta` on all three rotary axes, as the model's own generate does. Its images are encoded once per
prefill (a retracted sequence re-encodes them).

Invariants: weights change only through `load_tensors` / `load_from_disk`, which validate every name, shape
and dtype before they copy anything (and, for a snapshot with a `manifest.json`, every file's size and
digest), so a rejected update leaves the old weights intact. While the weights
are released (`release_weights`), forwards and weight loads are refused with an error instead of running on
empty storage.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from workers.engine.memory import WeightStash, return_freed_memory
from workers.engine.sampling import RowResult, RowSampling, sample_rows
from workers.vlm_processor import PixelInputs, VlmProcessor, rope_positions, vlm_model_type

if TYPE_CHECKING:
    from transformers import DynamicCache

log = logging.getLogger("rayless.engine.runner")


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class WeightUpdateError(ValueError):
    """A weight update that was rejected; the old weights are kept."""


class WeightsReleasedError(RuntimeError):
    """A forward or a weight load while the weights are released."""


@dataclass
class PrefillItem:
    """One sequence to prefill: `tokens` are all its tokens so far (prompt, plus output when re-prefilled)."""

    seq_id: str
    tokens: list[int]
    sampling: RowSampling | None  # None: prefill only (max_new_tokens 0), nothing sampled, no cache row kept
    input_logprob_start: int | None = None  # first prompt position whose logprob is wanted, or None
    token_ids: tuple[int, ...] = ()  # SGLang's token_ids_logprob: ids whose logprob each input position reports
    top_logprobs_num: int = 0  # each input position's top-k too (also for a prefill-only request, as SGLang)
    # miles' patched SGLang's token_ids_logprob_positions: the ids each input position (from 0) reports
    position_token_ids: tuple[tuple[int, ...], ...] | None = None
    vision: PixelInputs | None = None  # a VLM sequence's images (tokens hold their expanded placeholders)


@dataclass
class StepOutput:
    sample: RowResult | None
    # (logprob or None at position 0, token id) for prompt positions from input_logprob_start on.
    input_logprobs: list[tuple[float | None, int]] | None = None
    input_top_logprobs: list[list[tuple[float, int]]] | None = None
    # SGLang's input_token_ids_logprobs: the logprobs of the asked ids at each of those positions, in their order.
    input_token_ids_logprobs: list[list[tuple[float, int]]] | None = None


class ModelRunner:
    def __init__(
        self,
        model_path: str,
        *,
        tokenizer_path: str | None = None,
        dtype: str = "float32",
        device: str = "cpu",
        weight_spill_dir: str | None = None,
        attn_implementation: str | None = None,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        path = Path(model_path)
        if not path.is_dir():
            raise FileNotFoundError(
                f"--model-path {model_path!r} is not a directory with a Hugging Face model"
            )
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch_dtype: Any = "auto" if dtype == "auto" else getattr(torch, dtype)
        # transformers places a model on a device at load only through accelerate (not a dependency): load on
        # the host, then move. Later weight loads go from disk to the device tensor by tensor.
        # attn_implementation: the trainer's, under --rl-on-policy-target (None: transformers' default, sdpa)
        extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
        self._check_manifest(path)  # an engine started on a snapshot of ours (a pinned eval fleet)
        self.vlm_type = vlm_model_type(path)
        model_class = AutoModelForImageTextToText if self.vlm_type else AutoModelForCausalLM
        model, info = model_class.from_pretrained(str(path), dtype=torch_dtype, output_loading_info=True, **extra)
        missing = sorted(info.get("missing_keys") or [])
        if missing:  # transformers would serve them as fresh random weights
            raise FileNotFoundError(f"--model-path {model_path}: its weights lack {len(missing)} of the model's "
                                    f"parameters, e.g. {', '.join(missing[:3])}")
        self.model = model.to(self.device).eval()
        self.model.requires_grad_(False)
        self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path or path))
        self.vision_processor = VlmProcessor(path) if self.vlm_type else None
        # A VLM's vision tokens are never sampled (as the min_new_tokens ban: after the logprob is taken, so
        # logprobs stay the model's): a response's image token would have no image for the trainer to scatter.
        self.vision_token_ids: tuple[int, ...] = tuple(sorted({
            int(value) for name in ("image_token_id", "video_token_id", "vision_start_token_id",
                                    "vision_end_token_id")
            if isinstance(value := getattr(self.model.config, name, None), int)})) if self.vlm_type else ()
        self.config = self.model.config
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.eos_ids = self._eos_ids()
        # transformers 5 renamed the forward's cache argument from past_key_values to cache.
        params = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.rows: list[str] = []
        self._kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._pad = torch.zeros(0, dtype=torch.long, device=self.device)
        self._last_token: dict[str, int] = {}
        self._rope_delta: dict[str, int] = {}  # a VLM row's multimodal rope delta (absent: 0)
        self.stash = WeightStash(self.model, self.device, weight_spill_dir)

    def _tensor(self, data: Sequence[int] | Sequence[Sequence[int]]) -> torch.Tensor:
        return torch.tensor(data, dtype=torch.long, device=self.device)

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.config):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return frozenset(ids)

    # ---- forward passes -------------------------------------------------------------------------------

    def _new_cache(self, kv: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None) -> DynamicCache:
        from transformers import DynamicCache

        if kv:
            return DynamicCache(ddp_cache_data=list(kv), config=self.config)
        return DynamicCache(config=self.config)

    def _forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None, cache: DynamicCache,
        vision: PixelInputs | None = None,
    ):
        if self.stash.released:
            raise WeightsReleasedError("the weights are released; call /resume_memory_occupation first")
        kwargs: dict[str, object] = {self._cache_kwarg: cache}
        if vision is not None:
            kwargs.update(pixel_values=vision.pixel_values.to(self.device, self.model.dtype),
                          image_grid_thw=vision.image_grid_thw.to(self.device))
        return self.model(
            input_ids=input_ids, position_ids=position_ids, attention_mask=mask, use_cache=True, **kwargs
        ).logits

    @staticmethod
    def _cache_tensors(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer.keys, layer.values) for layer in cache.layers]

    @torch.inference_mode()
    def step(
        self, *, drop: Sequence[str], prefills: Sequence[PrefillItem], decode: dict[str, RowSampling] | None
    ) -> dict[str, StepOutput]:
        """Drop finished rows, decode one token for every cached row (when `decode` is given: it must name
        exactly the cached rows), then prefill `prefills` and sample their first token."""
        self._drop(set(drop))
        outputs: dict[str, StepOutput] = {}
        if decode:
            if set(decode) != set(self.rows):
                raise RuntimeError(
                    f"decode rows {sorted(decode)} differ from the cached rows {sorted(self.rows)}"
                )
            logits = self._decode()
            results = sample_rows(logits, [decode[row] for row in self.rows])
            for row, result in zip(self.rows, results, strict=True):
                outputs[row] = StepOutput(sample=result)
                self._last_token[row] = result.token
        for item in prefills:
            outputs[item.seq_id] = self._prefill(item)
        return outputs

    def _decode(self) -> torch.Tensor:
        length = self._kv[0][0].shape[2]
        tokens = self._tensor([[self._last_token[row]] for row in self.rows])
        deltas = self._tensor([self._rope_delta.get(row, 0) for row in self.rows])
        positions = (length - self._pad + deltas).unsqueeze(1)
        columns = torch.arange(length + 1, device=self.device).unsqueeze(0)
        mask = (columns >= self._pad.unsqueeze(1)).long()
        cache = self._new_cache(self._kv)
        logits = self._forward(tokens, positions, mask, cache)[:, -1, :]
        self._kv = self._cache_tensors(cache)
        return logits

    def _prefill(self, item: PrefillItem) -> StepOutput:
        tokens = self._tensor([item.tokens])
        positions = torch.arange(len(item.tokens), device=self.device).unsqueeze(0)
        if item.vision is not None and self.vision_processor is not None:
            positions, deltas = rope_positions(self.model, tokens, item.vision.image_grid_thw.to(self.device),
                                               self.vision_processor.image_token_id)
            self._rope_delta[item.seq_id] = int(deltas.reshape(-1)[0])
        cache = self._new_cache()
        logits = self._forward(tokens, positions, None, cache, item.vision)[0].float()
        output = StepOutput(sample=None)
        if item.input_logprob_start is not None:
            start = max(0, min(item.input_logprob_start, len(item.tokens) - 1))
            entries: list[tuple[float | None, int]] = []
            if start == 0:
                entries.append((None, item.tokens[0]))
            first = max(start, 1)
            if first < len(item.tokens):
                # Position i's logprob comes from the logits at position i - 1.
                rows = torch.log_softmax(logits[first - 1 : len(item.tokens) - 1], dim=-1)
                targets = self._tensor(item.tokens[first:]).unsqueeze(1)
                values = rows.gather(1, targets).squeeze(1).tolist()
                entries.extend(zip(values, item.tokens[first:], strict=True))
            output.input_logprobs = entries
            top_num = item.top_logprobs_num
            if top_num > 0 and first < len(item.tokens):
                values, indices = rows.topk(min(top_num, rows.shape[-1]), dim=-1)
                tops = [
                    list(zip(v, i, strict=True))
                    for v, i in zip(values.tolist(), indices.tolist(), strict=True)
                ]
                output.input_top_logprobs = ([[]] if start == 0 else []) + tops
            if item.position_token_ids is not None and first < len(item.tokens):
                output.input_token_ids_logprobs = ([[]] if start == 0 else []) + [
                    list(zip(rows[i - first, list(ids)].tolist(), ids, strict=True)) if ids else []
                    for i, ids in enumerate(item.position_token_ids[first:len(item.tokens)], start=first)
                ]
            elif item.token_ids and first < len(item.tokens):
                ids = list(item.token_ids)
                picked = rows[:, ids].tolist()
                output.input_token_ids_logprobs = ([[]] if start == 0 else []) + [
                    list(zip(values, ids, strict=True)) for values in picked
                ]
        if item.sampling is not None:
            output.sample = sample_rows(logits[-1:], [item.sampling])[0]
            self._merge(item.seq_id, self._cache_tensors(cache), output.sample.token)
        else:
            self._rope_delta.pop(item.seq_id, None)
        return output

    # ---- the batch cache ------------------------------------------------------------------------------

    def _merge(self, seq_id: str, kv: list[tuple[torch.Tensor, torch.Tensor]], last_token: int) -> None:
        new_length = kv[0][0].shape[2]
        if not self.rows:
            self._kv, self._pad = kv, torch.zeros(1, dtype=torch.long, device=self.device)
        else:
            length = self._kv[0][0].shape[2]
            grow, extra = max(0, new_length - length), max(0, length - new_length)
            merged = []
            for (keys, values), (new_keys, new_values) in zip(self._kv, kv, strict=True):
                merged.append(
                    (
                        torch.cat([F.pad(keys, (0, 0, grow, 0)), F.pad(new_keys, (0, 0, extra, 0))]),
                        torch.cat([F.pad(values, (0, 0, grow, 0)), F.pad(new_values, (0, 0, extra, 0))]),
                    )
                )
            self._kv = merged
            self._pad = torch.cat([self._pad + grow, self._tensor([extra])])
        self.rows.append(seq_id)
        self._last_token[seq_id] = last_token

    def _drop(self, drop: set[str]) -> None:
        if not drop or not self.rows:
            return
        keep = [i for i, row in enumerate(self.rows) if row not in drop]
        for row in self.rows:
            if row in drop:
                self._last_token.pop(row, None)
                self._rope_delta.pop(row, None)
        if not keep:
            self.reset()
            return
        index = self._tensor(keep)
        self.rows = [self.rows[i] for i in keep]
        pad = self._pad[index]
        trim = int(pad.min())  # columns that are padding in every remaining row
        self._kv = [(k[index, :, trim:], v[index, :, trim:]) for k, v in self._kv]
        self._pad = pad - trim

    def reset(self) -> None:
        """Forget every cached row (flush, retract, release)."""
        self.rows, self._kv, self._last_token, self._rope_delta = [], [], {}, {}
        self._pad = torch.zeros(0, dtype=torch.long, device=self.device)

    def release_kv_cache(self, *, return_memory: bool = True) -> None:
        """Drop the cache and hand its memory back to the system (release_memory_occupation: kv_cache);
        `return_memory=False` when the weights are released next, which returns both at once."""
        self.reset()
        if return_memory:
            return_freed_memory(self.device)

    def release_weights(self) -> int:
        """Free the weights (see `memory.WeightStash`); returns the bytes freed."""
        self.reset()
        return self.stash.release()

    def restore_weights(self) -> None:
        self.stash.restore()

    @property
    def weights_released(self) -> bool:
        return self.stash.released

    def cached_tokens(self) -> int:
        return 0 if not self.rows else int(len(self.rows) * self._kv[0][0].shape[2] - self._pad.sum())

    # ---- weights ----------------------------------------------------------------------------------------

    def _validate(self, incoming: dict[str, tuple[tuple[int, ...], torch.dtype]], *, require_all: bool) -> None:
        """Check names, shapes and dtypes of an update before anything is copied.

        `incoming`: name -> (shape, dtype). `require_all`: every parameter of the model
        must be covered (a full snapshot from disk); a tied weight counts as covered through either name."""
        if self.stash.released:
            raise WeightUpdateError(
                "weights rejected, old weights kept: the weights are released; "
                "call /resume_memory_occupation with tags [\"weights\"] first"
            )
        if not incoming:
            raise WeightUpdateError("no tensors to load")
        state = self.model.state_dict(keep_vars=True)
        problems: list[str] = []
        for name, (shape, dtype) in incoming.items():
            target = state.get(name)
            if target is None:
                problems.append(f"unknown parameter {name!r}")
            elif tuple(target.shape) != tuple(shape):
                problems.append(f"{name}: shape {tuple(shape)} != model's {tuple(target.shape)}")
            elif not (dtype.is_floating_point and target.is_floating_point()) and dtype != target.dtype:
                problems.append(f"{name}: dtype {dtype} cannot load into {target.dtype}")
        if require_all and not problems:
            covered = {id(state[name]) for name in incoming}
            missing = [name for name, p in self.model.named_parameters() if id(p) not in covered]
            if missing:
                problems.append(
                    f"missing parameters: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}"
                )
        if problems:
            shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
            raise WeightUpdateError(f"weights rejected, old weights kept: {shown}")

    def load_tensors(self, tensors: dict[str, torch.Tensor], *, require_all: bool) -> int:
        """Validate then copy `tensors` (on any device) into the model; returns how many were loaded."""
        self._validate({n: (tuple(t.shape), t.dtype) for n, t in tensors.items()}, require_all=require_all)
        state = self.model.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, tensor in tensors.items():
                state[name].data.copy_(tensor.to(state[name].dtype))
        return len(tensors)

    def load_from_disk(self, model_path: str) -> int:
        """Load a full snapshot (safetensors files) straight onto the model's device, one tensor at a time, so
        an update never holds a second copy of the model; validated from the files' headers first."""
        from safetensors import SafetensorError, safe_open

        path = Path(model_path)
        if path.is_file():
            files = [path]
        elif path.is_dir():
            single = path / "model.safetensors"
            files = [single] if single.is_file() else sorted(path.glob("*.safetensors"))
        else:
            raise WeightUpdateError(f"model_path {model_path!r} does not exist")
        if not files:
            raise WeightUpdateError(f"no *.safetensors file in {model_path!r}")
        self._check_manifest(path)
        device = "cpu" if self.device.type == "cpu" else str(self.device)
        try:
            handles = [safe_open(str(file), framework="pt", device=device) for file in files]
            where: dict[str, tuple[Any, str]] = {}  # the model's name -> (file, the name stored there)
            incoming: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
            state = self.model.state_dict(keep_vars=True)
            for handle in handles:
                for stored in handle.keys():
                    tensor_slice = handle.get_slice(stored)
                    kind = tensor_slice.get_dtype()  # "F32", "BF16", "I64", ...
                    if kind not in _SAFETENSORS_DTYPES:
                        raise WeightUpdateError(f"{stored}: dtype {kind} is not supported")
                    name = self._model_name(stored, state)
                    incoming[name] = (tuple(tensor_slice.get_shape()), _SAFETENSORS_DTYPES[kind])
                    where[name] = (handle, stored)
            self._validate(incoming, require_all=True)
            with torch.no_grad():
                for name, (handle, stored) in where.items():
                    state[name].data.copy_(handle.get_tensor(stored).to(state[name].dtype))
        except (SafetensorError, OSError) as error:
            raise WeightUpdateError(f"cannot read {model_path}: {error}") from error
        return len(incoming)

    def _model_name(self, stored: str, state: dict[str, Any]) -> str:
        """The model's name of a tensor stored under `stored`. A vision-language checkpoint as transformers saves
        it (and the hub holds Qwen2-VL / Qwen2.5-VL) names the language model `model.layers...` and the tower
        `visual...`, where the loaded model has `model.language_model.layers...` and `model.visual...`: SGLang's
        loader takes both forms, and so does this one. Any other name is kept (and checked by `_validate`)."""
        if not self.vlm_type or stored in state:
            return stored
        if stored.startswith("visual."):
            renamed = "model." + stored
        elif stored.startswith("model.") and not stored.startswith(("model.language_model.", "model.visual.")):
            renamed = "model.language_model." + stored[len("model."):]
        else:
            return stored
        return renamed if renamed in state else stored

    def load_delta(self, model_path: str, current_version: str) -> int:
        """Apply a delta directory (`weight_delta`) to the weights held at `current_version`: every changed
        tensor is computed and checked against its checksum before any is copied in; returns how many changed."""
        from workers.shared_torch.weight_delta import DeltaError, apply_delta

        if self.stash.released:
            self._validate({}, require_all=False)  # raises: the weights are released
        state = self.model.state_dict()
        try:
            tensors = apply_delta(model_path, state, current_version=current_version)
        except DeltaError as error:
            raise WeightUpdateError(str(error)) from None
        return self.load_tensors(tensors, require_all=False) if tensors else 0

    def weights_by_name(self, name: str) -> torch.Tensor:
        """One parameter as the model holds it (SGLang's /get_weights_by_name)."""
        tensor = self.model.state_dict().get(name)
        if tensor is None:
            raise WeightUpdateError(f"unknown parameter {name!r}")
        return tensor.detach().to("cpu")

    @staticmethod
    def _check_manifest(path: Path) -> None:
        """A snapshot rayless wrote carries `manifest.json`: every file it lists must have its size and digest
        (a damaged or half-copied snapshot is refused before a byte of it loads). Others (SGLang's callers'
        directories) have none and load as they are."""
        from workers.boundary.manifest import MANIFEST, CheckpointError, check_manifest, hub_cache_root

        if not (path.is_dir() and (path / MANIFEST).is_file()):
            return
        try:
            check_manifest(path, links_within=hub_cache_root(path))  # a --save-hf export fetched from the Hub
        except CheckpointError as error:
            raise WeightUpdateError(f"refusing the snapshot: {error}") from None

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(t.shape) for name, t in self.model.state_dict().items()}
