"""`rayless make-tiny-model` writes a model directory that transformers loads offline and that generates."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch


def test_make_tiny_model_loads_offline_and_generates(tmp_path: Path) -> None:
    directory = tmp_path / "tiny"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-m", "coordinator.cli", "make-tiny-model", str(directory)],
                            capture_output=True, text=True, env=env, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert "parameters" in result.stdout
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert (directory / name).is_file(), name

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
    assert 50_000 < sum(p.numel() for p in model.parameters()) < 5_000_000
    ids = tokenizer("3 7 1=")["input_ids"]
    assert len(ids) == 6 and tokenizer.decode(ids) == "3 7 1="  # one token per character
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "1 2"}], add_generation_prompt=True,
                                         tokenize=False)
    assert chat.endswith("<|im_start|>assistant\n")
    torch.manual_seed(0)
    out = model.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=True,
                         pad_token_id=tokenizer.pad_token_id)
    assert out.shape == (1, 11)


def test_same_seed_gives_identical_weights(tmp_path: Path) -> None:
    from workers.tiny_model import TinyModelSpec, build_tiny_model

    first = build_tiny_model(tmp_path / "a")
    second = build_tiny_model(tmp_path / "b")
    other = build_tiny_model(tmp_path / "c", TinyModelSpec(seed=1))
    weights = (first / "model.safetensors").read_bytes()
    assert weights == (second / "model.safetensors").read_bytes()
    assert weights != (other / "model.safetensors").read_bytes()


def test_untied_head_is_a_head_of_its_own_with_the_same_outputs(tmp_path: Path) -> None:
    """`make-tiny-model --untied-head` (LoRA's recipe adapts the head): the tied model's weights and outputs,
    with `lm_head` a separate tensor in the file. The CLI's entry point runs in this process (the first test
    runs it as a subprocess, offline; another interpreter importing torch again would show nothing more)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from coordinator.cli import main as rayless
    from workers.tiny_model import build_tiny_model

    assert rayless(["make-tiny-model", str(tmp_path / "untied"), "--untied-head"]) == 0

    tied_dir = build_tiny_model(tmp_path / "tied")
    tied, untied = load_file(str(tied_dir / "model.safetensors")), load_file(str(tmp_path / "untied" /
                                                                                 "model.safetensors"))
    assert "lm_head.weight" not in tied and set(untied) == {*tied, "lm_head.weight"}
    assert all(torch.equal(tied[name], untied[name]) for name in tied)
    assert torch.equal(untied["lm_head.weight"], tied["model.embed_tokens.weight"])
    models = [AutoModelForCausalLM.from_pretrained(d, local_files_only=True) for d in (tied_dir, tmp_path / "untied")]
    assert models[0].config.tie_word_embeddings and not models[1].config.tie_word_embeddings
    assert models[1].lm_head.weight.data_ptr() != models[1].model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([[5, 6, 7, 8]])
    assert torch.equal(models[0](ids).logits, models[1](ids).logits)
