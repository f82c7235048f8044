"""Models out, in one process: `--save-hf` formatted as slime formats it and checked before any launch; the
Hugging Face directories `weight_export` writes (sharded past a size, swapped in whole, never over another
directory); `rayless export` of a full and a LoRA checkpoint giving the trained (merged) weights, and its errors
naming the file with exit 2. Whole runs with `--save-hf` are in the integration tests of RL, SFT and LoRA."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from coordinator.checks.preflight import check_checkpoints
from coordinator.cli import main as rayless
from coordinator.config import parse_config
from coordinator.config.checkpoint import save_hf_path
from coordinator.config.fields import ConfigError
from tests.support.hf_dirs import file_weights, loads_and_generates, max_difference
from workers.protocol.train_settings import LoraSettings
from workers.train_rank import checkpoint as ckpt
from workers.train_rank import checkpoint_files, lora, weight_export
from workers.train_rank.optim import build_optimizer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

SPEC = LoraSettings(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))


def job(model_dir: Path, *flags: str) -> list[str]:
    return ["--hf-checkpoint", str(model_dir), "--prompt-data", "builtin:first_digit", "--rollout-num-engines",
            "1", "--num-rollout", "2", "--rollout-batch-size", "2", *flags]


# ------------------------------------------------------------------------------------------ --save-hf


def test_save_hf_is_formatted_with_the_rollout_id_as_slime_formats_it() -> None:
    assert save_hf_path("/out/hf/{rollout_id}", 7) == "/out/hf/7"
    assert save_hf_path("/out/iter_{rollout_id:07d}_hf", 12) == "/out/iter_0000012_hf"
    assert save_hf_path("/out/hf", 3) == "/out/hf"  # no field: the same directory, replaced at each save
    assert save_hf_path("/out/{{literal}}/{rollout_id}", 1) == "/out/{literal}/1"


@pytest.mark.parametrize(("template", "message"), [
    ("/out/{step}", r"--save-hf /out/\{step\}: \{step\} is not a field of the path; the only one is \{rollout_id\}"),
    ("/out/{", r"--save-hf /out/\{: not a format string"),
    ("/out/{0}", r"--save-hf /out/\{0\}: a positional field"),
])
def test_a_save_hf_template_that_cannot_be_formatted_fails_at_parse(tiny_model_dir: Path, template: str,
                                                                  message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(job(tiny_model_dir, "--save-hf", template))


def test_save_hf_alone_saves_at_the_interval_and_the_flags_need_a_place_to_save(tiny_model_dir: Path) -> None:
    config = parse_config(job(tiny_model_dir, "--save-hf", "/tmp/hf/{rollout_id}", "--save-interval", "2"))
    assert config.checkpoint.saves and config.checkpoint.save is None
    with pytest.raises(ConfigError, match=r"--save-interval needs --save DIR \(or --save-hf DIR\)"):
        parse_config(job(tiny_model_dir, "--save-interval", "2"))


def test_a_bad_save_hf_exits_2_before_anything_launches(tiny_model_dir: Path, capsys: pytest.CaptureFixture,
                                                         tmp_path: Path) -> None:
    code = rayless(["train", *job(tiny_model_dir, "--save-hf", "/out/{iteration}", "--run-dir", str(tmp_path))])
    assert code == 2
    assert "--save-hf /out/{iteration}: {iteration} is not a field" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_save_hf_may_not_name_the_starting_model_or_a_busy_directory_and_must_be_writable(tiny_model_dir: Path,
                                                                      tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--save-hf .*: the --hf-checkpoint directory itself"):
        check_checkpoints(parse_config(job(tiny_model_dir, "--save-hf", str(tiny_model_dir))))
    with pytest.raises(ConfigError, match=r"--save-hf .*: the --save directory itself"):
        check_checkpoints(parse_config(job(tiny_model_dir, "--save", str(tmp_path / "ckpt"), "--save-hf",
                                           str(tmp_path / "ckpt"))))
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("")
    with pytest.raises(ConfigError, match=r"--save-hf .*busy holds files and is not a Hugging Face model directory"):
        check_checkpoints(parse_config(job(tiny_model_dir, "--save-hf", str(busy))))
    notes, _ = check_checkpoints(parse_config(job(tiny_model_dir, "--save-hf", str(tmp_path / "hf/{rollout_id}"))))
    assert f"--save-hf {tmp_path / 'hf' / '0'}: writable (will be created in {tmp_path})" in notes
    locked = tmp_path / "file"
    locked.write_text("")
    with pytest.raises(ConfigError, match=r"--save-hf .*file/0: cannot be written"):
        check_checkpoints(parse_config(job(tiny_model_dir, "--save-hf", str(locked / "{rollout_id}"))))


# ------------------------------------------------------------------------ the Hugging Face directories


def perturbed(model_dir: Path, seed: int) -> torch.nn.Module:
    """The tiny model with every weight moved (as after training), so a directory of the base would not pass."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.01)
    return model


def assert_same_weights(directory: Path, expected: dict[str, torch.Tensor]) -> None:
    """`directory` holds `expected` (tied aliases dropped) to 1e-6, and transformers loads it so and generates."""
    assert max_difference(file_weights(directory), expected) <= 1e-6
    loaded = loads_and_generates(directory)
    assert max_difference({name: loaded[name] for name in expected}, expected) <= 1e-6


def test_a_directory_past_the_shard_size_is_sharded_with_an_index_and_replaced_whole(tiny_model_dir: Path,
                                                                                    tmp_path: Path) -> None:
    state = weight_export.full_state_dict(perturbed(tiny_model_dir, 1), sharded=False)
    out = tmp_path / "hf"
    weight_export.write_hf_directory(state, source_dir=tiny_model_dir, directory=out, max_shard_bytes=60_000)
    index = json.loads((out / weight_export.INDEX_FILE).read_text())
    shards = sorted(path.name for path in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(index["weight_map"]) == set(state) and set(index["weight_map"].values()) == set(shards)
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    assert_same_weights(out, state)

    # the next save to the same directory replaces it: no shard of the earlier one is left to confuse a loader
    newer = weight_export.full_state_dict(perturbed(tiny_model_dir, 2), sharded=False)
    weight_export.write_hf_directory(newer, source_dir=tiny_model_dir, directory=out)
    assert not list(out.glob("model-*")) and not (out / weight_export.INDEX_FILE).exists()
    assert_same_weights(out, newer)
    assert [path.name for path in tmp_path.iterdir()] == ["hf"]  # nothing left beside it


def test_a_directory_is_never_written_over_something_else_and_a_failed_save_keeps_the_last(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    state = weight_export.full_state_dict(perturbed(tiny_model_dir, 1), sharded=False)
    other = tmp_path / "notes"
    other.mkdir()
    (other / "mine.txt").write_text("keep me")
    with pytest.raises(weight_export.HfDirectoryError, match=r"notes: exists and is not a Hugging Face model"):
        weight_export.write_hf_directory(state, source_dir=tiny_model_dir, directory=other)
    assert [path.name for path in other.iterdir()] == ["mine.txt"]

    out = tmp_path / "hf"
    weight_export.write_hf_directory(state, source_dir=tiny_model_dir, directory=out)

    def disk_full(_: Path) -> None:
        raise OSError("No space left on device")

    with pytest.raises(OSError, match="No space left"):
        weight_export.write_hf_directory({}, source_dir=tiny_model_dir, directory=out, write_extra=disk_full)
    assert_same_weights(out, state)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["hf", "notes"]


# ------------------------------------------------------------------------------------- rayless export


def save_trained(model: torch.nn.Module, save_dir: Path, base: Path, *, adapters: LoraSettings | None = None,
                 record_base: bool = True) -> Path:
    """A checkpoint as the ranks write it (`save_checkpoint` in one process), after one optimizer step."""
    optimizer = build_optimizer(model, lr=1e-2, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
    model(input_ids=torch.tensor([[5, 9, 12]]), labels=torch.tensor([[5, 9, 12]])).loss.backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)

    def write_adapter(directory: Path) -> None:
        assert adapters is not None
        lora.write_adapter(model, adapters, directory / lora.ADAPTER_DIR, base_model_path=str(base), write=True)

    return ckpt.save_checkpoint(
        save_dir, 4, model=model, optimizer=optimizer, scheduler=scheduler, extra={},
        adapters=adapters.record() if adapters is not None else None,
        write_files=write_adapter if adapters is not None else None,
        base_model={"hf_checkpoint": str(base), "dtype": "float32"} if record_base else None)


def test_export_of_a_full_checkpoint_is_the_trained_model(tiny_model_dir: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    model = perturbed(tiny_model_dir, 3)
    save_trained(model, tmp_path / "ckpt", tiny_model_dir)
    assert rayless(["export", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    assert "(rollout 4, the full model)" in capsys.readouterr().out
    assert_same_weights(tmp_path / "out", weight_export.full_state_dict(model, sharded=False))
    assert not (tmp_path / "out" / lora.ADAPTER_DIR).exists()


def test_export_of_a_lora_checkpoint_merges_and_puts_the_adapter_beside(tiny_model_dir: Path,
                                                                       tmp_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    lora.apply_lora(model, SPEC)
    with torch.no_grad():
        for name, parameter in lora.adapter_parameters(model).items():
            if ".lora_B." in name:
                parameter.normal_(std=0.05)
    checkpoint = save_trained(model, tmp_path / "ckpt", tiny_model_dir, adapters=SPEC)
    out = tmp_path / "out"
    assert rayless(["export", str(checkpoint), str(out)]) == 0
    merged = weight_export.full_state_dict(model, sharded=False)
    assert not any(".lora_" in name or "base_layer" in name for name in merged)
    assert_same_weights(out, merged)
    # the adapter beside the merged weights: the checkpoint's own PEFT files, tensor for tensor
    adapter, saved = load_file(str(out / "adapter" / lora.ADAPTER_WEIGHTS)), load_file(
        str(checkpoint / "adapter" / lora.ADAPTER_WEIGHTS))
    assert adapter.keys() == saved.keys() and all(torch.equal(adapter[k], saved[k]) for k in adapter)
    config = json.loads((out / "adapter" / lora.ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8.0)
    # the merged model computes what the adapted one does
    merged_model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    model.eval()
    ids = torch.tensor([[5, 9, 12, 7]])
    with torch.no_grad():
        assert (merged_model(input_ids=ids).logits - model(input_ids=ids).logits).abs().max() <= 1e-5


def test_export_errors_name_the_file_and_exit_2(tiny_model_dir: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture) -> None:
    def export(*args: Path | str) -> str:
        assert rayless(["export", *map(str, args)]) == 2
        return capsys.readouterr().err

    assert f"rayless export: {tmp_path}: no rayless checkpoint there" in export(tmp_path, tmp_path / "out")

    full = save_trained(perturbed(tiny_model_dir, 3), tmp_path / "ckpt", tiny_model_dir)

    def variant(name: str, extra: dict[str, object]) -> Path:
        """A complete checkpoint (manifest rewritten) whose extra.json is `extra`."""
        directory = tmp_path / name / "rollout_2"
        shutil.copytree(full, directory)
        (directory / "extra.json").write_text(json.dumps(extra))
        checkpoint_files.write_manifest(directory)
        return directory

    old = variant("old", {"rollout_id": 2, "extra": {}})  # a rayless that recorded no base model
    assert (f"{old / 'extra.json'} records no base model (a checkpoint of an older rayless): pass "
            "--hf-checkpoint DIR") in export(old, tmp_path / "out")
    assert f"--hf-checkpoint {tmp_path}: not a Hugging Face model directory" in export(
        old, tmp_path / "out", "--hf-checkpoint", tmp_path)

    moved = variant("moved", {"rollout_id": 2, "extra": {}, "base_model": {"hf_checkpoint": "/gone"}})
    assert (f"/gone (the base model {moved / 'extra.json'} records): not a Hugging Face model directory "
            "(no config.json); pass --hf-checkpoint DIR if it has moved") in export(moved, tmp_path / "out")

    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "mine.txt").write_text("")
    assert f"OUT {busy}: exists, is not empty and is not a Hugging Face model directory" in export(full, busy)
    assert f"OUT {tiny_model_dir}: the base model itself" in export(full, tiny_model_dir)

    from workers.tiny_model import TinyModelSpec, build_tiny_model

    wider = build_tiny_model(tmp_path / "wider", TinyModelSpec(hidden_size=32, intermediate_size=64))
    err = export(full, tmp_path / "out", "--hf-checkpoint", wider)
    assert f"{full}: its weights do not fit the model of {wider}" in err
    assert not (tmp_path / "out").exists()


def test_an_exported_directory_carries_a_manifest_checked_when_it_is_loaded_again(
        tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """`rayless export` (and `--save-hf`, the same writer) lists every file with its digest, the adapter's too;
    given as `--hf-checkpoint`, a damaged byte is refused naming the file; a plain directory (no manifest)
    still loads. A full checkpoint under `--load` is held to the shapes of the model the ranks will build."""
    from coordinator.checks.preflight import preflight

    monkeypatch.setenv("RAYLESS_CACHE_DIR", str(tmp_path / "cache"))  # no pass remembered from elsewhere
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    lora.apply_lora(model, SPEC)
    checkpoint = save_trained(model, tmp_path / "lora", tiny_model_dir, adapters=SPEC)
    out = tmp_path / "out"
    assert rayless(["export", str(checkpoint), str(out)]) == 0
    listed = json.loads((out / checkpoint_files.MANIFEST).read_text())["files"]
    assert sorted(listed) == sorted(str(p.relative_to(out)) for p in out.rglob("*")
                                    if p.is_file() and p.name != checkpoint_files.MANIFEST)
    assert {"model.safetensors", "adapter/adapter_model.safetensors", "config.json"} <= set(listed)
    checkpoint_files.check_manifest(out / lora.ADAPTER_DIR)  # the adapter dir is a --lora-adapter-path of its own
    notes = preflight(parse_config(job(out)))
    assert any(note.startswith(f"--hf-checkpoint: {out}: 24 tensors; verified: manifest.json's sizes and digests; "
                               "headers and sizes; every parameter") for note in notes), notes
    plain = preflight(parse_config(job(tiny_model_dir)))
    assert not any("manifest" in note for note in plain if note.startswith("--hf-checkpoint:")), plain

    weights = out / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0x01  # a tensor's byte: the header still fits, only the digest sees it
    weights.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=f"^--hf-checkpoint: {weights}: its content does not match the manifest"):
        preflight(parse_config(job(out)))
    assert train_exit(job(out), capsys) == (2, f"rayless train: error: --hf-checkpoint: {weights}: its content does "
                                               "not match the manifest's digest (damaged after the save)")

    full = save_trained(perturbed(tiny_model_dir, 3), tmp_path / "full", tiny_model_dir)
    held = ("--load: 24 tensors' shapes match the model's weights (1 not stored under that name there, e.g. a "
            "tied head: the ranks' load checks them)")
    notes = preflight(parse_config(job(tiny_model_dir, "--load", str(full))))
    assert held in notes, notes
    # `rayless train --load` up to the launch, in a fresh interpreter: the checkpoint read and held to the model
    # without torch (the model's own pass remembered from the preflight above, as from the run that saved it)
    said = subprocess.run([sys.executable, "-c", RESUME_PREFLIGHT, *job(tiny_model_dir, "--load", str(full))],
                          capture_output=True, text=True, timeout=120, check=False)
    assert said.returncode == 0, said.stderr
    seen = json.loads(said.stdout.strip().splitlines()[-1])
    assert seen["torch"] == [] and held in seen["notes"], seen
    assert f"--load: {full} verified (sizes, digests, metadata)" in seen["notes"], seen
    from workers.tiny_model import TinyModelSpec, build_tiny_model

    wider = build_tiny_model(tmp_path / "wider", TinyModelSpec(hidden_size=32, intermediate_size=64))
    with pytest.raises(ConfigError, match=rf"^--load: {full}/\.metadata: tensor model\.embed_tokens\.weight is "
                                          rf"\[89, 64\], the model of {wider}/config\.json needs \[89, 32\]"):
        preflight(parse_config(job(wider, "--load", str(full))))


RESUME_PREFLIGHT = """
import json, sys
import coordinator.run  # what `rayless train` runs next, imported
from coordinator.checks.resolve import resolve
from coordinator.config import parse_config

resolved = resolve(parse_config(sys.argv[1:]))  # as `rayless train` does before it launches anything
assert resolved.plan is not None
from coordinator.checks.preflight import preflight
notes = preflight(resolved.config)
print(json.dumps({"notes": notes, "torch": sorted(m for m in sys.modules if m.split(".")[0] == "torch")[:5]}))
"""


def train_exit(flags: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str]:
    code = rayless(["train", *flags])
    return code, capsys.readouterr().err.strip().splitlines()[-1]
