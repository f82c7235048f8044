"""Attention within each sample of a packed row, on any device, without flash-attn: `packed_sdpa`, a
transformers attention implementation (registered in `AttentionInterface` and `AttentionMaskInterface`) that
splits the row where its position ids restart and attends within each sample only.

Three paths for a packed row (`choose_path`; `RAYLESS_PACKED_ATTENTION` = auto | varlen | grouped | per_sample
picks one for a bench):
- `varlen` (auto on CUDA, compute capability ≥ 8.0, bf16/fp16): PyTorch's own `torch.nn.attention.varlen.
  varlen_attn` over the whole batch with the samples' cu_seqlens — one kernel call per layer, forward and
  backward, through the flash-attention kernels bundled with PyTorch (no flash-attn package).
- `grouped` (auto elsewhere, the CPU): one causal sdpa call per distinct sample length, that length's samples
  stacked as one batch; a run of consecutive equal-length samples is a view of the row, so nothing is copied
  for it. Bit-identical to `per_sample` on CPU (sdpa computes batch entries independently), gradients too.
- `per_sample`: one causal sdpa call per sample and layer (the first version; kept to compare against).

Why (issue 38): the block-diagonal mask transformers builds for a packed row over plain sdpa makes the kernel
compute every pair of the row — 35.6 s against per-sample sdpa's 1.1 s for the attention of 16 × 1,024 tokens
on this machine's CPU. FlexAttention with a document mask has no backward on CPU ("FlexAttention does not
support backward on CPU"); `varlen_attn` calls `aten::_flash_attention_forward`, which has no CPU kernel
(NotImplementedError on torch 2.13 here). On CPU the per-call cost is small beside the attention itself, so
grouping gains where lengths repeat (measured on 2 loaded cores, forward + backward of the attention alone,
4 query / 2 KV heads of 64, best of 6: 8 × 1,024 equal samples 0.40 CPU-s grouped vs 0.55 per sample; 16
samples of 5 lengths 0.78 vs 0.84; 40 long-tailed samples of 37 lengths 0.84 vs 0.97). On a GPU the launch is
the cost: per-sample sdpa made 14,336 kernel calls per forward of the Qwen3-0.6B-shaped batch (512 samples ×
28 layers) and ran at 7.9 % MFU on an H200; varlen makes one per layer and micro-batch. `flash_attention_2` is
used instead whenever it is asked for (`--attn-implementation`).

Invariants: for a row without padding whose position ids count up from 0 per sample, the output equals the
output of each sample's own causal sdpa forward (the unpacked one), gradients included; nothing of size
row × row is ever built. Anything else — a padding mask, a KV cache (queries ≠ keys), a non-causal module —
goes to transformers' own `sdpa` mask and attention unchanged. Sliding-window layers are refused (the window
lives in the mask this path skips). Asking for `varlen` where it cannot run is an error, never a fallback.
"""

from __future__ import annotations

import importlib.util
import os
import weakref
from collections.abc import Callable
from typing import Any

import torch

#: the attn_implementation name the trainer's models load with (when none is given)
PACKED_SDPA = "packed_sdpa"

#: the paths `packed_sdpa` can take for a packed row (`choose_path`), and the variable that asks for one
VARLEN, GROUPED, PER_SAMPLE, AUTO = "varlen", "grouped", "per_sample", "auto"
MODES = (AUTO, VARLEN, GROUPED, PER_SAMPLE)
MODE_ENV = "RAYLESS_PACKED_ATTENTION"

_registered = False
#: (the position-ids tensor, its version, its rows' (start, end) spans): one forward's layers share one tensor
_cached: tuple[Any, int, list[list[tuple[int, int]]]] | None = None
#: (those spans, their cu_seqlens on the device, the longest sample): the varlen path's per-forward input
_cu_cached: tuple[list[list[tuple[int, int]]], torch.Tensor, int] | None = None


def resolve(requested: str | None) -> str:
    """The attn_implementation to load a training model with: `requested` when given (`sdpa`, `eager`,
    `flash_attention_2`, ...), else `packed_sdpa` (registered on first use)."""
    if requested:
        return requested
    register()
    return PACKED_SDPA


def register() -> None:
    """Make `packed_sdpa` a name transformers accepts (idempotent; per process)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PACKED_SDPA, packed_sdpa_forward)
    AttentionMaskInterface.register(PACKED_SDPA, packed_sdpa_mask)
    _registered = True


def packed_sdpa_mask(batch_size: int, q_length: int, kv_length: int, q_offset: Any = 0, kv_offset: Any = 0,
                     mask_function: Any = None, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> Any:
    """No mask for a row without padding or cache (the attention splits it by position ids); otherwise
    transformers' sdpa mask, exactly as `sdpa` builds it."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    if attention_mask is None and q_length == kv_length and isinstance(q_offset, int) and q_offset == 0 \
            and isinstance(kv_offset, int) and kv_offset == 0:
        return None
    return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset,
                     mask_function if mask_function is not None else causal_mask_function, attention_mask, **kwargs)


def segment_spans(position_ids: torch.Tensor, batch: int, length: int) -> list[list[tuple[int, int]]]:
    """Per row, the (start, end) of each sample: a new one wherever the position id is not the previous + 1
    (transformers' rule for a packed row, `find_packed_sequence_indices`)."""
    positions = position_ids.expand(batch, length)
    breaks = (positions[:, 1:] != positions[:, :-1] + 1).nonzero().tolist()
    starts: list[list[int]] = [[0] for _ in range(batch)]
    for row, index in breaks:
        starts[row].append(index + 1)
    return [list(zip(row, [*row[1:], length], strict=True)) for row in starts]


def _spans(position_ids: torch.Tensor, batch: int, length: int) -> list[list[tuple[int, int]]]:
    """`segment_spans`, computed once per forward: every layer receives the same position-ids tensor (on CUDA
    this saves a device sync per layer)."""
    global _cached
    if _cached is not None:
        ref, version, spans = _cached
        if ref() is position_ids and version == position_ids._version and len(spans) == batch \
                and spans[0][-1][1] == length:
            return spans
    spans = segment_spans(position_ids, batch, length)
    _cached = (weakref.ref(position_ids), position_ids._version, spans)
    return spans


def packed_sdpa_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                        is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """[B, H, L, D] query (keys/values [B, H_kv, L, D]) → ([B, L, H, D], None), as transformers' sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if kwargs.get("sliding_window") is not None:
        raise NotImplementedError(
            f"attn_implementation {PACKED_SDPA!r} does not support sliding-window attention "
            f"({type(module).__name__}); pass --attn-implementation sdpa or flash_attention_2")
    position_ids = kwargs.get("position_ids")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    batch, _, length, _ = query.shape
    if attention_mask is not None or position_ids is None or key.shape[2] != length or not causal or length < 2:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    spans = _spans(position_ids, batch, length)
    if all(len(row) == 1 for row in spans):  # nothing packed: one causal call, as plain sdpa
        return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling,
                                      is_causal=True, **kwargs)
    path = choose_path(mode(), device_type=query.device.type, dtype=query.dtype, head_dim=query.shape[-1],
                       capability=_capability(query.device), dropout=dropout if module.training else 0.0)
    if path == VARLEN:
        return _varlen(query, key, value, spans, scaling), None

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return sdpa_attention_forward(module, q, k, v, None, dropout=dropout, scaling=scaling, is_causal=True,
                                      **kwargs)[0]

    if path == PER_SAMPLE:
        return _per_sample(query, key, value, spans, attend), None
    return _grouped(query, key, value, spans, attend), None


def mode() -> str:
    """The path asked for (`RAYLESS_PACKED_ATTENTION`): `auto` (default), `varlen`, `grouped` or `per_sample`;
    the benches set it to compare the paths side by side."""
    value = os.environ.get(MODE_ENV, AUTO) or AUTO
    if value not in MODES:
        raise ValueError(f"{MODE_ENV}={value!r}: expected one of {', '.join(MODES)}")
    return value


def choose_path(requested: str, *, device_type: str, dtype: torch.dtype, head_dim: int,
                capability: tuple[int, int] | None, dropout: float) -> str:
    """`varlen` where PyTorch's own varlen kernel can run (its bundled flash attention: CUDA, compute capability
    8.0 or newer, fp16/bf16, head dim a multiple of 8 up to 256, no dropout), else `grouped`; `per_sample` only
    when asked. Asking for `varlen` where it cannot run is an error, not a silent fallback."""
    if requested in (GROUPED, PER_SAMPLE):
        return requested
    reason = _varlen_unusable(device_type, dtype, head_dim, capability, dropout)
    if requested == VARLEN and reason:
        raise RuntimeError(f"{MODE_ENV}=varlen cannot run here: {reason}")
    return GROUPED if reason else VARLEN


def _varlen_unusable(device_type: str, dtype: torch.dtype, head_dim: int, capability: tuple[int, int] | None,
                     dropout: float) -> str:
    if device_type != "cuda":
        return f"no varlen kernel on {device_type} (aten::_flash_attention_forward is CUDA-only)"
    if capability is None or capability < (8, 0):
        return f"compute capability {capability} (flash attention needs 8.0 or newer)"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {dtype} (flash attention takes float16 or bfloat16)"
    if head_dim % 8 or head_dim > 256:
        return f"head dim {head_dim} (flash attention takes multiples of 8 up to 256)"
    if dropout:
        return f"attention dropout {dropout} (varlen_attn has none)"
    if not torch.backends.cuda.flash_sdp_enabled():
        return "flash attention disabled (torch.backends.cuda.enable_flash_sdp(False))"
    if importlib.util.find_spec("torch.nn.attention.varlen") is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen"
    return ""


def _capability(device: torch.device) -> tuple[int, int] | None:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _pieces(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, spans: list[list[tuple[int, int]]]
            ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each sample's [1, H, n, D] query, key and value, in row order: views made with `split`, so backward joins
    the samples' gradients in one concatenation per row instead of one row-sized zero tensor per sample."""
    pieces = []
    for row, row_spans in enumerate(spans):
        sizes = [end - start for start, end in row_spans]
        pieces.extend(zip(*(tensor[row : row + 1].split(sizes, dim=2) for tensor in (query, key, value)),
                          strict=True))
    return pieces


def _rows(parts: list[torch.Tensor], spans: list[list[tuple[int, int]]]) -> torch.Tensor:
    """Samples' [1, n, H, D] outputs in row order → [B, L, H, D]."""
    rows, index = [], 0
    for row_spans in spans:
        rows.append(torch.cat(parts[index : index + len(row_spans)], dim=1))
        index += len(row_spans)
    return torch.cat(rows, dim=0)


def _per_sample(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, spans: list[list[tuple[int, int]]],
                attend: Attend) -> torch.Tensor:
    """One causal sdpa call per sample (the path before grouping; kept for comparison)."""
    return _rows([attend(q, k, v) for q, k, v in _pieces(query, key, value, spans)], spans)


def _grouped(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, spans: list[list[tuple[int, int]]],
             attend: Attend) -> torch.Tensor:
    """One causal sdpa call per distinct sample length in the batch, the samples of that length as one
    [n, H, length, D] batch. A run of consecutive equal-length samples is a view of the row (no copy in, none
    out); only runs of one length in different places are concatenated. A sample's output is its own call's
    (sdpa treats batch entries independently: bit-identical on CPU), and no pair outside a sample is computed."""
    runs = _runs(spans)
    by_length: dict[int, list[int]] = {}
    for index, (_, _, _, length) in enumerate(runs):
        by_length.setdefault(length, []).append(index)
    outputs: list[torch.Tensor | None] = [None] * len(runs)
    views = [_run_views(tensor, runs) for tensor in (query, key, value)]
    for indices in by_length.values():
        inputs = [[per_run[i] for i in indices] for per_run in views]
        stacked = attend(*(group[0] if len(group) == 1 else torch.cat(group) for group in inputs))
        for i, part in zip(indices, stacked.split([runs[i][2] for i in indices]), strict=True):
            outputs[i] = part.reshape(1, -1, *part.shape[2:])  # [count, n, H, D] → [1, count·n, H, D]
    rows: list[torch.Tensor] = []
    for row in range(len(spans)):
        parts = [out for (run_row, _, _, _), out in zip(runs, outputs, strict=True) if run_row == row and out is not None]
        rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=1))
    return rows[0] if len(rows) == 1 else torch.cat(rows)


def _runs(spans: list[list[tuple[int, int]]]) -> list[tuple[int, int, int, int]]:
    """(row, start, count, length) of each maximal run of consecutive equal-length samples, in row order."""
    runs: list[tuple[int, int, int, int]] = []
    for row, row_spans in enumerate(spans):
        for start, end in row_spans:
            if runs and runs[-1][0] == row and runs[-1][3] == end - start:
                runs[-1] = (row, runs[-1][1], runs[-1][2] + 1, end - start)
            else:
                runs.append((row, start, 1, end - start))
    return runs


def _run_views(tensor: torch.Tensor, runs: list[tuple[int, int, int, int]]) -> list[torch.Tensor]:
    """[B, H, L, D] → each run's [count, H, length, D], views made with `split` (rows, then runs): backward then
    joins the runs' gradients in one concatenation per row, not one row-sized zero tensor per run as slicing
    would; a row that is one run (all its samples of one length) is reshaped, not split (no concatenation)."""
    rows = [tensor] if tensor.shape[0] == 1 else tensor.split(1)
    views = []
    for row, row_tensor in enumerate(rows):
        row_runs = [run for run in runs if run[0] == row]
        sizes = [count * length for _, _, count, length in row_runs]
        pieces = [row_tensor.squeeze(0)] if len(sizes) == 1 else row_tensor.squeeze(0).split(sizes, dim=1)
        views.extend(piece.unflatten(1, (count, length)).transpose(0, 1)
                     for piece, (_, _, count, length) in zip(pieces, row_runs, strict=True))
    return views


def _varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, spans: list[list[tuple[int, int]]],
            scaling: float | None) -> torch.Tensor:
    """PyTorch's varlen attention over the whole batch as one sequence of samples: one kernel call per layer.
    [B, H, L, D] → tokens-major [B·L, H, D] (the projections are token-major already, so mostly a view)."""
    from torch.nn.attention import varlen

    batch, heads, length, dim = query.shape
    cu_seqlens, longest = _cu_seqlens(spans, length, query.device)

    def tokens(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.transpose(1, 2).reshape(batch * length, tensor.shape[1], dim)

    out = varlen.varlen_attn(tokens(query), tokens(key), tokens(value), cu_seqlens, cu_seqlens, longest, longest,
                             scale=scaling, window_size=(-1, 0), enable_gqa=key.shape[1] != heads)
    assert isinstance(out, torch.Tensor)
    return out.reshape(batch, length, heads, dim)


def _cu_seqlens(spans: list[list[tuple[int, int]]], length: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """The samples' cumulative starts over the flattened batch (int32 on the device) and the longest sample,
    once per forward like the spans."""
    global _cu_cached
    if _cu_cached is not None and _cu_cached[0] is spans and _cu_cached[1].device == device:
        return _cu_cached[1], _cu_cached[2]
    starts = [row * length + start for row, row_spans in enumerate(spans) for start, _ in row_spans]
    cu_seqlens = torch.tensor([*starts, len(spans) * length], dtype=torch.int32, device=device)
    longest = max(end - start for row_spans in spans for start, end in row_spans)
    _cu_cached = (spans, cu_seqlens, longest)
    return cu_seqlens, longest
