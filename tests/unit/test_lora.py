"""LoRA in one process: the merged weights the engines get compute what the adapted model computes; only
adapters train; a checkpoint holds the adapters and their optimizer state and refuses a run of other adapters;
the PEFT-format adapter loads back (`--lora-adapter-path`); miles' flags and start-up checks; the dry run."""

from __future__ import annotations

import io
import json
from pathlib import Path

import msgspec
import pytest
import torch
from transformers import AutoModelForCausalLM

from coordinator.checks.dry_run import dry_run
from coordinator.checks.trainable import check_trainable
from coordinator.config import parse_config
from coordinator.config.fields import ConfigError, ConfigWarning
from coordinator.train.settings import train_settings
from tests.support.train_settings import flat_view
from workers.protocol.train_settings import LoraSettings
from workers.train_rank import checkpoint as ckpt
from workers.train_rank import lora, weight_buckets, weight_export
from workers.train_rank.optim import build_optimizer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def spec(rank: int = 4, targets: list[str] = ALL, alpha: float = 8.0) -> LoraSettings:
    return LoraSettings(rank=rank, alpha=alpha, target_modules=tuple(targets))


def adapted(model_dir: Path, the_spec: LoraSettings | None = None, *, seed: int = 0) -> torch.nn.Module:
    """The tiny model with adapters whose B is random (as after training: a zero B would merge to nothing)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora.apply_lora(model, the_spec or spec())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".lora_B." in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return model


def logits(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([[5, 9, 12, 7, 30, 31, 8]])).logits


def test_the_merged_weights_are_a_plain_model_computing_the_adapted_one(tiny_model_dir: Path) -> None:
    model = adapted(tiny_model_dir)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    state = weight_export.full_state_dict(model, sharded=False)
    assert not [name for name in state if "lora_" in name or "base_layer" in name]
    # the same names, dtypes and shapes as the plain model's own export, hence the same bucket plan
    assert weight_export.manifest(state) == weight_export.manifest(weight_export.full_state_dict(plain, sharded=False))
    assert weight_buckets.bucket_manifest(model, 4096) == weight_buckets.bucket_manifest(plain, 4096)
    before = logits(plain)
    plain.load_state_dict(state, strict=False)  # lm_head is tied to the embeddings, not sent
    assert (logits(plain) - logits(model)).abs().max() <= 1e-5
    assert (logits(plain) - before).abs().max() > 1e-3  # the adapters changed the function


def test_only_the_adapters_train_and_the_optimizer_holds_them_alone(tiny_model_dir: Path) -> None:
    model = adapted(tiny_model_dir)
    frozen = {name: p.detach().clone() for name, p in model.named_parameters() if ".lora_" not in name}
    optimizer = build_optimizer(model, lr=1e-2, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert held == {id(p) for p in lora.adapter_parameters(model).values()}
    trainable, total = lora.trainable_counts(model)
    assert trainable == sum(p.numel() for p in lora.adapter_parameters(model).values()) < total
    model.train()
    model(input_ids=torch.tensor([[5, 9, 12, 7]]), labels=torch.tensor([[5, 9, 12, 7]])).loss.backward()
    optimizer.step()
    assert all(torch.equal(p, frozen[name]) for name, p in model.named_parameters() if name in frozen)


def test_adapters_get_gradients_under_activation_checkpointing(tiny_model_dir: Path) -> None:
    from workers.train_rank.model import enable_activation_checkpointing

    model = adapted(tiny_model_dir)
    enable_activation_checkpointing(model)  # frozen embeddings: the checkpointed inputs need no grad
    model.train()
    model(input_ids=torch.tensor([[5, 9, 12, 7]]), labels=torch.tensor([[5, 9, 12, 7]])).loss.backward()
    grads = [p.grad for p in lora.adapter_parameters(model).values()]
    assert all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)
    assert all(p.grad is None for name, p in model.named_parameters() if ".lora_" not in name)


def test_a_checkpoint_holds_the_adapters_and_loads_only_into_the_same_adapters(tiny_model_dir: Path,
                                                                               tmp_path: Path) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    def state(seed: int, the_spec: LoraSettings | None = None) -> dict:
        model = adapted(tiny_model_dir, the_spec, seed=seed)
        optimizer = build_optimizer(model, lr=1e-2, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
        model(input_ids=torch.tensor([[5, 9, 12]]), labels=torch.tensor([[5, 9, 12]])).loss.backward()
        optimizer.step()
        return {"model": model, "optimizer": optimizer,
                "scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)}

    saved = state(seed=1)
    record = spec().record()
    path = ckpt.save_checkpoint(tmp_path, 3, extra={}, adapters=record, **saved)
    keys = list(FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    assert keys and all(".lora_" in key for key in keys if key.startswith(("model.", "optim.state.")))
    assert ckpt.checkpoint_adapters(tmp_path) == record

    resumed = state(seed=2)
    ckpt.load_checkpoint(tmp_path, adapters=record, **resumed)
    for (name, a), b in zip(lora.adapter_parameters(saved["model"]).items(),
                            lora.adapter_parameters(resumed["model"]).values(), strict=True):
        assert torch.equal(a, b), name
    moments = [torch.equal(saved["optimizer"].state[p]["exp_avg"], resumed["optimizer"].state[q]["exp_avg"])
               for p, q in zip(saved["optimizer"].param_groups[0]["params"],
                               resumed["optimizer"].param_groups[0]["params"], strict=True)]
    assert moments and all(moments)

    # --ref-load of a LoRA checkpoint: the Hugging Face base with the checkpoint's adapters (as the trainer builds it)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    lora.apply_lora(reference, msgspec.convert(ckpt.checkpoint_adapters(tmp_path), LoraSettings))
    ckpt.load_model_weights(tmp_path, reference)
    assert (logits(reference) - logits(saved["model"])).abs().max() == 0

    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    plain_optimizer = build_optimizer(plain, lr=1e-2, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
    with pytest.raises(ckpt.CheckpointError, match=r"holds LoRA adapters .* this run trains the full model"):
        ckpt.load_checkpoint(tmp_path, model=plain, optimizer=plain_optimizer,
                             scheduler=torch.optim.lr_scheduler.LambdaLR(plain_optimizer, lambda s: 1.0))
    other = spec(rank=2)
    with pytest.raises(ckpt.CheckpointError, match=r"rank 4.*this run trains rank 2"):
        ckpt.load_checkpoint(tmp_path, adapters=other.record(), **state(seed=3, the_spec=other))
    # and before any rank starts: the start-up checks read the checkpoint's record
    with pytest.raises(ConfigError, match=r"--load .*holds LoRA adapters .* this run trains the full model"):
        check_trainable(parse_config(job(tiny_model_dir, "--load", str(tmp_path))))
    assert check_trainable(parse_config(job(tiny_model_dir, "--load", str(tmp_path), "--lora-rank", "4",
                                            "--lora-alpha", "8", "--target-modules", ",".join(ALL))))


# peft's PeftModel reads transformers' deprecated `is_gradient_checkpointing` (peft 0.21 on transformers 5)
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_the_peft_format_adapter_loads_back_as_lora_adapter_path(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = adapted(tiny_model_dir)
    lora.write_adapter(model, spec(), tmp_path, base_model_path=str(tiny_model_dir), write=True)
    assert json.loads((tmp_path / lora.ADAPTER_CONFIG).read_text())["r"] == 4
    fresh = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    lora.apply_lora(fresh, msgspec.structs.replace(spec(), adapter_path=str(tmp_path)))
    assert (logits(fresh) - logits(model)).abs().max() == 0
    # peft itself reads it as its own format
    from peft import PeftModel

    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(tmp_path))
    assert (logits(peft_model) - logits(model)).abs().max() <= 1e-6
    with pytest.raises(lora.LoraError, match="has shape"):
        lora.apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                        msgspec.structs.replace(spec(rank=2), adapter_path=str(tmp_path)))


def job(model_dir: Path, *flags: str) -> list[str]:
    return ["--hf-checkpoint", str(model_dir), "--prompt-data", "builtin:first_digit", "--rollout-num-engines",
            "1", "--num-rollout", "2", "--rollout-batch-size", "2", *flags]


def test_miles_flags_resolve_to_the_ranks_adapters(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = parse_config(job(tiny_model_dir, "--lora-rank", "8", "--lora-alpha", "32", "--lora-dropout", "0.05",
                              "--target-modules", "linear_qkv,linear_fc2", "--exclude-modules", "k_proj"))
    assert flat_view(train_settings(config))["lora"] == {
        "rank": 8, "alpha": 32.0, "dropout": 0.05, "target_modules": ["q_proj", "v_proj", "down_proj"],
        "exclude_modules": [], "adapter_path": None}
    assert flat_view(train_settings(parse_config(job(tiny_model_dir))))["lora"] is None
    all_linear = parse_config(job(tiny_model_dir, "--lora-rank", "4", "--target-modules", "all-linear"))
    assert flat_view(train_settings(all_linear))["lora"]["target_modules"] == ALL
    # an MLA config adds its projections to all-linear, as miles
    mla = tmp_path / "mla"
    mla.mkdir()
    (mla / "config.json").write_text(json.dumps({"kv_lora_rank": 512, "q_lora_rank": 1536}))
    assert all_linear.lora.resolved_targets(str(mla))[-4:] == ("kv_a_proj_with_mqa", "kv_b_proj", "q_a_proj",
                                                               "q_b_proj")
    # --lora-adapter-path alone takes the adapter's rank, alpha and targets
    lora.write_adapter(adapted(tiny_model_dir), spec(), tmp_path / "adapter", base_model_path="x", write=True)
    from_file = parse_config(job(tiny_model_dir, "--lora-adapter-path", str(tmp_path / "adapter")))
    assert flat_view(train_settings(from_file))["lora"]["rank"] == 4 and flat_view(train_settings(from_file))["lora"]["alpha"] == 8.0
    with pytest.raises(ConfigError, match="--lora-rank 8 differs from the rank 4"):
        flat_view(train_settings(parse_config(job(tiny_model_dir, "--lora-rank", "8", "--target-modules", "q_proj",
                         "--lora-adapter-path", str(tmp_path / "adapter")))))


@pytest.mark.parametrize(("flags", "message"), [
    (["--lora-rank", "8"], "'--target-modules' is required when LoRA is enabled"),
    (["--lora-rank", "8", "--target-modules", "q_proj", "--lora-train-only"], "--lora-train-only"),
    (["--experts-shared-outer-loras"], "--experts-shared-outer-loras"),
    (["--lora-dropout", "1.0"], "--lora-dropout must be < 1"),
])
def test_contradictory_lora_flags_fail_at_parse(tiny_model_dir: Path, flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(job(tiny_model_dir, *flags))


@pytest.mark.parametrize(("flags", "message"), [
    (["--lora-rank", "4", "--target-modules", "q_proj", "--lora-sync-from-tensor"], "--lora-sync-from-tensor: no effect"),
    (["--target-modules", "q_proj"], "no effect without --lora-rank"),
])
def test_lora_flags_with_no_effect_warn(tiny_model_dir: Path, flags: list[str], message: str) -> None:
    with pytest.warns(ConfigWarning, match=message):
        parse_config(job(tiny_model_dir, *flags))


@pytest.mark.parametrize(("targets", "message"), [
    ("q_proj,foo_proj", r"target modules \['foo_proj'\] are not Linear modules of Qwen3ForCausalLM"),
    ("lm_head", "share their weight with the embeddings"),
])
def test_targets_the_model_lacks_fail_at_start_up(tiny_model_dir: Path, targets: str, message: str) -> None:
    config = parse_config(job(tiny_model_dir, "--lora-rank", "4", "--target-modules", targets))
    with pytest.raises(ConfigError, match=message):
        check_trainable(config)


def test_lora_on_a_vision_language_model_is_checked_on_the_class_the_ranks_load(tmp_path: Path) -> None:
    """The start-up check builds a VLM as the ranks do (its own class, vision tower included), not as a causal
    LM, which transformers refuses for its config: the targets are checked and the adapters counted."""
    from transformers import AutoModelForImageTextToText

    from workers.tiny_vlm import build_tiny_vlm

    vlm = build_tiny_vlm(tmp_path / "vlm")
    total = sum(p.numel() for p in AutoModelForImageTextToText.from_pretrained(vlm).parameters())
    flags = ["--hf-checkpoint", str(vlm), "--prompt-data", "builtin:colour", "--rollout-num-engines", "1",
             "--num-rollout", "2", "--rollout-batch-size", "2", "--lora-rank", "4"]
    [note] = check_trainable(parse_config([*flags, "--target-modules", "all-linear"]))
    assert note.startswith("trainable parameters: ") and f" of {total:,} " in note and "LoRA rank 4" in note
    with pytest.raises(ConfigError, match="foo_proj"):
        check_trainable(parse_config([*flags, "--target-modules", "q_proj,foo_proj"]))


def test_the_dry_run_reports_the_trainable_parameters(tiny_model_dir: Path) -> None:
    total = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model_dir).parameters())
    for flags, expected in (([], f"trainable parameters: {total:,} (the full model)"),
                            (["--lora-rank", "4", "--target-modules", "all-linear"],
                             f"trainable parameters: 8,192 of {total:,} (10.26%): LoRA rank 4, alpha 16 on 14 "
                             "modules")):
        out, err = io.StringIO(), io.StringIO()
        status = dry_run(parse_config(job(tiny_model_dir, *flags)), mask=str, out=out, err=err)
        assert status == 0, err.getvalue()
        assert expected in out.getvalue(), out.getvalue()
