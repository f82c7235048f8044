"""Reading a Hugging Face model directory as a person would: its safetensors weights (one file or shards with
their index), and `transformers`' `AutoModelForCausalLM.from_pretrained` loading it and generating."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def file_weights(directory: Path) -> dict[str, Any]:
    """Every tensor of the directory's safetensors files, by name (`model.safetensors` or the index's shards)."""
    from safetensors.torch import load_file

    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    weights: dict[str, Any] = {}
    for name in files:
        weights.update(load_file(str(directory / name)))
    return weights


def max_difference(got: dict[str, Any], expected: dict[str, Any]) -> float:
    """The largest elementwise difference of two state dicts with the same names (asserted)."""
    assert sorted(got) == sorted(expected), sorted(set(got) ^ set(expected))
    return max(float((got[name].float() - tensor.float()).abs().max()) for name, tensor in expected.items())


def loads_and_generates(directory: Path, prompt: str = "7+1=") -> dict[str, Any]:
    """Load with `AutoModelForCausalLM` / `AutoTokenizer`, generate a few tokens greedily (asserted), and return
    the loaded model's state dict: what transformers made of the directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 3), out.shape
    return dict(model.state_dict())
