"""The model runner: the Hugging Face causal LM, its tokenizer, and the batch KV cache of the running sequences.

Owns every tensor of the engine. Its methods are blocking and run in a worker thread (the scheduler calls them
through `anyio.to_thread` while holding its model lock), so only one of them runs at a time.

The batch cache holds one row per running sequence, left-padded to a common length: row r's real tokens fill
the last `length - pad[r]` columns. Every forward passes an attention mask that hides the padding and explicit
position ids (a row's position is its own token count), so a sequence decoded in a batch gets the same logits
as alone, within float rounding. A new sequence is prefilled on its own (no padding) and then merged in; rows
of finished sequences are removed and all-padding columns trimmed.

Invariant: weights change only through `load_tensors`, which validates every name, shape and dtype before it
copies anything, so a rejected update leaves the old weights intact.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from workers.engine.sampling import RowResult, RowSampling, sample_rows

log = logging.getLogger("rayless.engine.runner")


class WeightUpdateError(ValueError):
    """A weight update that was rejected; the old weights are kept."""


@dataclass
class PrefillItem:
    """One sequence to prefill: `tokens` are all its tokens so far (prompt, plus output when re-prefilled)."""

    seq_id: str
    tokens: list[int]
    sampling: RowSampling | None  # None: prefill only (max_new_tokens 0), nothing sampled, no cache row kept
    input_logprob_start: int | None = None  # first prompt position whose logprob is wanted, or None


@dataclass
class StepOutput:
    sample: RowResult | None
    # (logprob or None at position 0, token id) for prompt positions from input_logprob_start on.
    input_logprobs: list[tuple[float | None, int]] | None = None
    input_top_logprobs: list[list[tuple[float, int]]] | None = None


class ModelRunner:
    def __init__(self, model_path: str, *, tokenizer_path: str | None = None, dtype: str = "float32") -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        path = Path(model_path)
        if not path.is_dir():
            raise FileNotFoundError(
                f"--model-path {model_path!r} is not a directory with a Hugging Face model"
            )
        torch_dtype: Any = "auto" if dtype == "auto" else getattr(torch, dtype)
        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype).eval()
        self.model.requires_grad_(False)
        self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path or path))
        self.config = self.model.config
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.eos_ids = self._eos_ids()
        # transformers 5 renamed the forward's cache argument from past_key_values to cache.
        params = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.rows: list[str] = []
        self._kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._pad = torch.zeros(0, dtype=torch.long)
        self._last_token: dict[str, int] = {}

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

    def _new_cache(self, kv: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None) -> Any:
        from transformers import DynamicCache

        if kv:
            return DynamicCache(ddp_cache_data=list(kv), config=self.config)
        return DynamicCache(config=self.config)

    def _forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None, cache: Any
    ):
        kwargs = {self._cache_kwarg: cache}
        return self.model(
            input_ids=input_ids, position_ids=position_ids, attention_mask=mask, use_cache=True, **kwargs
        ).logits

    @staticmethod
    def _cache_tensors(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
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
        tokens = torch.tensor([[self._last_token[row]] for row in self.rows])
        positions = (length - self._pad).unsqueeze(1)
        columns = torch.arange(length + 1).unsqueeze(0)
        mask = (columns >= self._pad.unsqueeze(1)).long()
        cache = self._new_cache(self._kv)
        logits = self._forward(tokens, positions, mask, cache)[:, -1, :]
        self._kv = self._cache_tensors(cache)
        return logits

    def _prefill(self, item: PrefillItem) -> StepOutput:
        tokens = torch.tensor([item.tokens])
        positions = torch.arange(len(item.tokens)).unsqueeze(0)
        cache = self._new_cache()
        logits = self._forward(tokens, positions, None, cache)[0].float()
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
                targets = torch.tensor(item.tokens[first:]).unsqueeze(1)
                values = rows.gather(1, targets).squeeze(1).tolist()
                entries.extend(zip(values, item.tokens[first:], strict=True))
            output.input_logprobs = entries
            top_num = item.sampling.top_logprobs_num if item.sampling else 0
            if top_num > 0 and first < len(item.tokens):
                values, indices = rows.topk(min(top_num, rows.shape[-1]), dim=-1)
                tops = [
                    list(zip(v, i, strict=True))
                    for v, i in zip(values.tolist(), indices.tolist(), strict=True)
                ]
                output.input_top_logprobs = ([[]] if start == 0 else []) + tops
        if item.sampling is not None:
            output.sample = sample_rows(logits[-1:], [item.sampling])[0]
            self._merge(item.seq_id, self._cache_tensors(cache), output.sample.token)
        return output

    # ---- the batch cache ------------------------------------------------------------------------------

    def _merge(self, seq_id: str, kv: list[tuple[torch.Tensor, torch.Tensor]], last_token: int) -> None:
        new_length = kv[0][0].shape[2]
        if not self.rows:
            self._kv, self._pad = kv, torch.zeros(1, dtype=torch.long)
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
            self._pad = torch.cat([self._pad + grow, torch.tensor([extra])])
        self.rows.append(seq_id)
        self._last_token[seq_id] = last_token

    def _drop(self, drop: set[str]) -> None:
        if not drop or not self.rows:
            return
        keep = [i for i, row in enumerate(self.rows) if row not in drop]
        for row in self.rows:
            if row in drop:
                self._last_token.pop(row, None)
        if not keep:
            self.reset()
            return
        index = torch.tensor(keep)
        self.rows = [self.rows[i] for i in keep]
        pad = self._pad[index]
        trim = int(pad.min())  # columns that are padding in every remaining row
        self._kv = [(k[index, :, trim:], v[index, :, trim:]) for k, v in self._kv]
        self._pad = pad - trim

    def reset(self) -> None:
        """Forget every cached row (flush, retract, release)."""
        self.rows, self._kv, self._last_token = [], [], {}
        self._pad = torch.zeros(0, dtype=torch.long)

    def cached_tokens(self) -> int:
        return 0 if not self.rows else int(len(self.rows) * self._kv[0][0].shape[2] - self._pad.sum())

    # ---- weights ----------------------------------------------------------------------------------------

    def load_tensors(self, tensors: dict[str, torch.Tensor], *, require_all: bool) -> int:
        """Validate then copy `tensors` into the model; returns how many were loaded.

        `require_all`: every parameter of the model must be covered (a full snapshot from disk); a tied weight
        counts as covered through either of its names."""
        if not tensors:
            raise WeightUpdateError("no tensors to load")
        state = self.model.state_dict(keep_vars=True)
        problems: list[str] = []
        for name, tensor in tensors.items():
            target = state.get(name)
            if target is None:
                problems.append(f"unknown parameter {name!r}")
            elif tuple(target.shape) != tuple(tensor.shape):
                problems.append(f"{name}: shape {tuple(tensor.shape)} != model's {tuple(target.shape)}")
            elif (
                not (tensor.is_floating_point() and target.is_floating_point())
                and tensor.dtype != target.dtype
            ):
                problems.append(f"{name}: dtype {tensor.dtype} cannot load into {target.dtype}")
        if require_all and not problems:
            covered = {state[name].data_ptr() for name in tensors}
            missing = [name for name, p in self.model.named_parameters() if p.data_ptr() not in covered]
            if missing:
                problems.append(
                    f"missing parameters: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}"
                )
        if problems:
            shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
            raise WeightUpdateError(f"weights rejected, old weights kept: {shown}")
        with torch.no_grad():
            for name, tensor in tensors.items():
                state[name].data.copy_(tensor.to(state[name].dtype))
        return len(tensors)

    def load_from_disk(self, model_path: str) -> int:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

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
        tensors: dict[str, torch.Tensor] = {}
        for file in files:
            try:
                tensors.update(load_file(str(file)))
            except (SafetensorError, OSError, ValueError) as error:
                raise WeightUpdateError(f"cannot read {file}: {error}") from error
        return self.load_tensors(tensors, require_all=True)

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(t.shape) for name, t in self.model.state_dict().items()}
