"""What is read from disk is verified before use (issues 39 and 41): drills on the files of one real checkpoint
written by `save_checkpoint` (made once for the module, copied per test) and of the tiny model.

Each damaged file is refused naming it; a `.metadata` that is a pickle of `os.system(...)` runs nothing under
`--load`, `--ref-load`, the ranks' own loads and a train-FT recovery, and `rayless train` exits 2 before any
launch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import pytest
import torch

from coordinator.checks.preflight import preflight
from coordinator.cli import main as rayless
from coordinator.cli import train_main
from coordinator.config import ConfigError, parse_config
from coordinator.train.recovery import RankRecovery
from tests.unit.test_checkpoint import State, save
from workers.train_rank import checkpoint as ckpt
from workers.train_rank import checkpoint_files as files
from workers.train_rank import checkpoint_weights as weights

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

BASE = ["--prompt-data", "builtin:first_digit", "--rollout-batch-size", "2", "--num-rollout", "1",
        "--rollout-num-engines", "1"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A save dir holding one real checkpoint, rollout 3 (never modified: tests copy it)."""
    directory = tmp_path_factory.mktemp("saved")
    save(directory, 3, 1.0)
    return directory


@pytest.fixture
def save_dir(saved: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "save"
    shutil.copytree(saved, copy)
    return copy


def plant_payload(checkpoint: Path, marker: Path) -> None:
    """A `.metadata` that runs `touch MARKER` when unpickled, with a manifest rewritten to match (an attacker
    writes both)."""
    import pickle  # noqa: TID251 - builds the hostile file under test; never loads one

    class Payload:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {marker}",))

    (checkpoint / ".metadata").write_bytes(pickle.dumps(Payload()))
    files.write_manifest(checkpoint)


def test_a_real_save_verifies_and_lists_every_file(save_dir: Path) -> None:
    directory = save_dir / "rollout_3"
    extra = files.verify_checkpoint(directory)
    assert extra.rollout_id == 3 and extra.extra == {"value": 1.0}
    listed = json.loads((directory / files.MANIFEST).read_text())["files"]
    assert sorted(listed) == sorted(p.name for p in directory.iterdir() if p.name != files.MANIFEST)
    meta = files.read_metadata(directory)
    assert "model.weight" in meta.state_dict_metadata


def test_the_pickle_payload_runs_nothing_on_any_load_path(save_dir: Path, tmp_path: Path, tiny_model_dir: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    directory = save_dir / "rollout_3"
    marker = tmp_path / "MARKER"
    plant_payload(directory, marker)
    refused = f"{directory / '.metadata'}: refusing to load posix.system"
    # the reader every path shares, and the ranks' own loads (a --load resume, a --ref-load reference)
    with pytest.raises(files.CheckpointError, match=refused):
        files.read_metadata(directory)
    with pytest.raises(files.CheckpointError, match=refused):
        ckpt.load_checkpoint(save_dir, **State().objects())  # type: ignore[arg-type]
    with pytest.raises(files.CheckpointError, match=refused):
        ckpt.load_model_weights(directory, torch.nn.Linear(4, 3))
    # rayless train: --load and --ref-load refused before anything launches, exit 2
    model = ["--hf-checkpoint", str(tiny_model_dir), *BASE]
    for flags in (["--load", str(save_dir)], ["--use-kl-loss", "--ref-load", str(directory)]):
        assert train_main([*model, *flags]) == 2
        said = capsys.readouterr().err
        assert f"rayless train: error: {flags[-2]}: {refused}" in said, said
    # rayless export of the checkpoint: refused naming the file, exit 2, nothing run
    assert rayless(["export", str(directory), str(tmp_path / "out"), "--hf-checkpoint", str(tiny_model_dir)]) == 2
    said = capsys.readouterr().err
    assert str(directory / ".metadata") in said and "refusing to load posix.system" in said, said
    assert not (tmp_path / "out").exists()
    assert not marker.exists()


def test_a_train_ft_reload_verifies_the_checkpoint_before_any_rank_reads_it(save_dir: Path,
                                                                            tmp_path: Path) -> None:
    marker = tmp_path / "MARKER"
    plant_payload(save_dir / "rollout_3", marker)
    loads: list[Any] = []

    class RestartedGroup:
        """STAND-IN for the TrainGroup after torchrun restarted its ranks (the FT integration tests restart
        them for real); only the checkpoint the recovery reads is under test here."""

        world_size = 1
        settings = SimpleNamespace(checkpoint=SimpleNamespace(save_dir=str(save_dir)))
        ranks: dict[int, Any] = {}

        async def wait_for_ranks(self, *, replacing: Any = ()) -> dict[int, Any]:
            return {}

        async def init(self, settings: Any) -> dict[str, Any]:
            return {}

        async def load_checkpoint(self, path: Any) -> Any:
            loads.append(path)

    with pytest.raises(files.CheckpointError, match=r"\.metadata: refusing to load posix\.system") as refused:
        anyio.run(RankRecovery(RestartedGroup(), max_recoveries=1).recover)  # type: ignore[arg-type]
    assert refused.value.exit_status == 2 and loads == [] and not marker.exists()


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def _shard(directory: Path) -> Path:
    return next(directory.glob("*.distcp"))


def _symlink_out(path: Path) -> None:
    outside = path.parent.parent.parent / f"outside-{path.name}"
    shutil.copy(path, outside)
    path.unlink()
    path.symlink_to(outside)


#: drill → (damage, rewrite the manifest to match, what the refusal says). With the manifest rewritten (as a
#: hand-edited checkpoint would be) the check of the file's own content must catch the damage.
DRILLS = {
    "truncated shard": (lambda d: _truncate(_shard(d)), True, "__0_0.distcp: truncated"),
    "truncated shard, manifest kept": (lambda d: _truncate(_shard(d)), False, "bytes, the manifest says"),
    "flipped byte in a shard": (lambda d: _flip(_shard(d)), False, "does not match the manifest's digest"),
    "missing shard": (lambda d: _shard(d).unlink(), True, "__0_0.distcp: missing (named by"),
    "shard symlinked out": (lambda d: _symlink_out(_shard(d)), True, "points outside"),
    "no manifest (unfinished save)": (lambda d: (d / files.MANIFEST).unlink(), False, "incomplete checkpoint"),
    "garbage extra.json": (lambda d: (d / "extra.json").write_text("{nope"), True, "extra.json: not valid JSON"),
    "deep extra.json": (lambda d: (d / "extra.json").write_text("[" * 100_000), True, "nested deeper"),
    "string rollout_id": (lambda d: (d / "extra.json").write_text('{"rollout_id": "x"}'), True,
                          "extra.json: Expected `int`, got `str` - at `$.rollout_id`"),
    "garbage scheduler.json": (lambda d: (d / "scheduler.json").write_text("[1, 2]"), True,
                               "scheduler.json: Expected `object`, got `array`"),
    "garbage rng file": (lambda d: (d / "rng_rank0.json").write_text('{"torch": [999]}'), True,
                         "rng_rank0.json: an RNG state holds values outside 0..255"),
    "garbage .metadata": (lambda d: (d / ".metadata").write_bytes(b"\x80\x05garbage"), True,
                          ".metadata: not DCP checkpoint metadata"),
    "metadata naming a shard outside": (lambda d: _rename_shard(d, "../x"), True,
                                        ".metadata: not DCP checkpoint metadata"),
}


def _rename_shard(directory: Path, name: str) -> None:
    """The real metadata with its shard's path rewritten, pickled as DCP writes it."""
    import pickle  # noqa: TID251 - writes the crafted file under test, as DCP's writer does; never loads one

    meta = files.read_metadata(directory)
    for info in meta.storage_data.values():
        info.relative_path = name
    (directory / ".metadata").write_bytes(pickle.dumps(meta))


@pytest.mark.parametrize("drill", sorted(DRILLS))
def test_each_damaged_file_is_refused_naming_it(save_dir: Path, drill: str) -> None:
    damage, remanifest, expected = DRILLS[drill]
    directory = save_dir / "rollout_3"
    damage(directory)
    if remanifest:
        files.write_manifest(directory)
    with pytest.raises((files.CheckpointError, ckpt.CheckpointError)) as refused:
        files.verify_checkpoint(ckpt.resolve_checkpoint(directory))
    assert expected in str(refused.value)
    assert str(directory) in str(refused.value)


RESUME_PROBE = """
import json, sys
import coordinator.run, coordinator.loop, coordinator.train.group, coordinator.train.recovery  # the resume path
from coordinator.checks.trainable import check_resume_adapters
from coordinator.config import parse_config
from coordinator.loop import SavedProgress
from workers import protocol
from workers.train_rank.checkpoint_layout import resolve_checkpoint
import msgspec

config = parse_config(sys.argv[1:])
check_resume_adapters(config)  # --load resolved, its adapters' record read (extra.json)
directory = resolve_checkpoint(config.load_plan().path)
sent = protocol.Response(1, True, protocol.LoadReply(3, {"rollout_state": {"next": 4}}, str(directory)))
reply = protocol.decode_body(protocol.encode_frame(sent)[4:]).result  # as the control server reads rank 0's
print(json.dumps({"path": reply.path, "rollout_id": reply.rollout_id,
                  "state": msgspec.convert(reply.extra, SavedProgress).rollout_state,
                  "torch": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))[:5]}))
"""


def test_the_resuming_coordinator_imports_no_torch(save_dir: Path, tiny_model_dir: Path) -> None:
    """The coordinator's resume path — its modules, `--load` resolved, the adapters' record read, rank 0's
    `LoadReply` decoded and the loop's saved progress read from it — in a fresh interpreter: no torch."""
    flags = ["--hf-checkpoint", str(tiny_model_dir), *BASE, "--load", str(save_dir)]
    result = subprocess.run([sys.executable, "-c", RESUME_PROBE, *flags], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen == {"path": str(save_dir / "rollout_3"), "rollout_id": 3, "state": {"next": 4}, "torch": []}


def test_a_load_of_a_damaged_checkpoint_is_refused_at_start_up(save_dir: Path, tiny_model_dir: Path) -> None:
    _flip(_shard(save_dir / "rollout_3"))
    with pytest.raises(ConfigError, match=r"^--load: .*__0_0\.distcp: its content does not match"):
        preflight(parse_config(["--hf-checkpoint", str(tiny_model_dir), *BASE, "--load", str(save_dir)]))


# --- safetensors: the model and adapters -------------------------------------------------------------------


@pytest.fixture
def model_copy(tiny_model_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "model"
    shutil.copytree(tiny_model_dir, copy)
    return copy


def test_a_truncated_model_is_refused_before_launch(model_copy: Path) -> None:
    weights_file = model_copy / "model.safetensors"
    with weights_file.open("r+b") as handle:
        handle.truncate(4096)
    with pytest.raises(ConfigError, match=r"^--hf-checkpoint: .*model\.safetensors: .*(truncated|header)"):
        preflight(parse_config(["--hf-checkpoint", str(model_copy), *BASE]))


def test_a_model_lacking_a_parameter_is_refused_not_filled_with_fresh_weights(model_copy: Path) -> None:
    """At start-up of a plain run (no LoRA, no dry run), and on the ranks as they load."""
    from safetensors.torch import load_file, save_file

    from workers.train_rank.model import MissingWeights, load_causal_lm

    path = model_copy / "model.safetensors"
    tensors = load_file(str(path))
    dropped = next(name for name in tensors if "layers.0" in name)
    del tensors[dropped]
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=f"^--hf-checkpoint: {path}: lacks 1 of the 25 tensors the model's "
                                          f"config.json needs: {dropped} \\(loading would fill them"):
        preflight(parse_config(["--hf-checkpoint", str(model_copy), *BASE]))
    with pytest.raises(MissingWeights, match=f"{model_copy}: its weights lack 1 of the model's parameters, e.g. "
                                             f"{dropped}"):
        load_causal_lm(str(model_copy), dtype=torch.float32, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def untied_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from workers.tiny_model import TinyModelSpec, build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("untied"), TinyModelSpec(untied_head=True))


def _rename(tensors: dict[str, torch.Tensor], old: str, new: str) -> None:
    tensors[new] = tensors.pop(old)


#: the model's weights edited → None (loads: transformers reports nothing missing) or what the refusal says.
#: The tiny model ties lm_head to the embeddings and stores the embeddings alone.
ARCHITECTURE_DRILLS: dict[str, tuple[bool, Any, str | None]] = {
    "tied head stored under its own name alone": (
        False, lambda t: _rename(t, "model.embed_tokens.weight", "lm_head.weight"), None),
    "stored without the base model's prefix": (
        False, lambda t: [_rename(t, k, k.removeprefix("model.")) for k in list(t) if k.startswith("model.")], None),
    "bfloat16 weights": (False, lambda t: t.__setitem__("model.norm.weight", t["model.norm.weight"].bfloat16()),
                         None),
    "tied, neither embeddings nor head": (
        False, lambda t: t.pop("model.embed_tokens.weight"),
        "lacks 2 of the 25 tensors the model's config.json needs: model.embed_tokens.weight, lm_head.weight"),
    "untied head missing": (True, lambda t: t.pop("lm_head.weight"),
                            "lacks 1 of the 25 tensors the model's config.json needs: lm_head.weight ("),
    "a whole layer missing": (
        False, lambda t: [t.pop(k) for k in list(t) if ".layers.1." in k],
        "lacks 11 of the 25 tensors the model's config.json needs: model.layers.1.self_attn.q_proj.weight, "
        "model.layers.1.self_attn.k_proj.weight, model.layers.1.self_attn.v_proj.weight, "
        "model.layers.1.self_attn.o_proj.weight, model.layers.1.self_attn.q_norm.weight, ... (loading"),
    "a tensor of the wrong shape": (
        False, lambda t: t.__setitem__("model.norm.weight", torch.ones(65)),
        "tensor model.norm.weight is [65], the model's config.json needs [64]"),
    "an integer tensor for a weight": (
        False, lambda t: t.__setitem__("model.norm.weight", torch.ones(64, dtype=torch.int32)),
        "tensor model.norm.weight is I32, the model holds floating-point weights there"),
}


@pytest.mark.parametrize("drill", list(ARCHITECTURE_DRILLS))
def test_the_weights_are_held_to_the_architecture_of_config_json(drill: str, tiny_model_dir: Path,
                                                                  untied_model: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """What transformers would fill with fresh weights (or refuse as it loads) is refused from the headers and
    the meta model; a tied head is never reported missing while its pair is stored."""
    from safetensors.torch import load_file, save_file

    from coordinator.checks.disk import verify_model_dir

    monkeypatch.setenv("RAYLESS_CACHE_DIR", str(tmp_path / "cache"))
    untied, edit, refusal = ARCHITECTURE_DRILLS[drill]
    model = tmp_path / "model"
    shutil.copytree(untied_model if untied else tiny_model_dir, model)
    tensors = load_file(str(model / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
    if refusal is None:
        assert "every parameter of the architecture stored, shapes as config.json says" in verify_model_dir(model)
        from workers.train_rank.model import load_causal_lm  # and the ranks' loader agrees: nothing missing

        load_causal_lm(str(model), dtype=torch.float32, device=torch.device("cpu"))
    else:
        with pytest.raises(files.CheckpointError) as refused:
            verify_model_dir(model)
        assert str(refused.value).startswith(f"{model / 'model.safetensors'}: ")
        assert refusal in str(refused.value)


def test_a_pass_is_remembered_and_changed_weights_are_checked_again(model_copy: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The second start from the same weights builds nothing (a start then imports no torch); weights that
    changed since are checked anew, so the memory never hides a missing parameter."""
    import subprocess
    import sys

    from safetensors.torch import load_file, save_file

    from coordinator.checks.disk import verify_model_dir

    cache = tmp_path / "cache"
    monkeypatch.setenv("RAYLESS_CACHE_DIR", str(cache))
    assert verify_model_dir(model_copy).endswith("shapes as config.json says")
    assert len(list((cache / "architecture-ok").iterdir())) == 1
    probe = ("import sys; from coordinator.checks.preflight import preflight; from coordinator.config import "
             f"parse_config; notes = preflight(parse_config({['--hf-checkpoint', str(model_copy), '--run-dir', str(tmp_path / 'run'), *BASE]!r})); "
             "print([n for n in notes if 'passed before' in n], 'torch' in sys.modules)")
    said = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120)
    assert said.stdout.strip().endswith("] False") and "passed before with these weights" in said.stdout, said
    tensors = load_file(str(model_copy / "model.safetensors"))
    tensors.pop("model.norm.weight")
    save_file(tensors, str(model_copy / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(files.CheckpointError, match=r"lacks 1 of the 25 tensors .*: model\.norm\.weight"):
        verify_model_dir(model_copy)


def test_a_config_transformers_does_not_build_is_remembered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           tiny_model_dir: Path) -> None:
    """A config AutoModelForCausalLM does not take (here T5's, a sequence-to-sequence model): its first start says
    the architecture was not checked, the next one builds nothing (no torch import for a check that cannot run).
    A vision-language model is not built for this check at all: its stored tensors carry the names transformers
    renames as it loads them."""
    from coordinator.checks import architecture
    from coordinator.checks.disk import verify_model_dir
    from workers.tiny_vlm import build_tiny_vlm

    monkeypatch.setenv("RAYLESS_CACHE_DIR", str(tmp_path / "cache"))
    seq2seq = Path(shutil.copytree(tiny_model_dir, tmp_path / "seq2seq"))
    config = json.loads((seq2seq / "config.json").read_text())
    (seq2seq / "config.json").write_text(json.dumps({**config, "model_type": "t5",
                                                     "architectures": ["T5ForConditionalGeneration"]}))
    assert verify_model_dir(seq2seq).endswith("the architecture was not checked (transformers does not build it "
                                              "here; the ranks will)")
    assert len(list((tmp_path / "cache" / "architecture-ok").iterdir())) == 1

    def built(model_dir: Path) -> None:
        raise AssertionError(f"the meta model of {model_dir} was built again")

    monkeypatch.setattr(architecture, "build_meta_model", built)
    assert "as an earlier start found" in verify_model_dir(seq2seq)
    vlm = build_tiny_vlm(tmp_path / "vlm")
    assert verify_model_dir(vlm).endswith("the architecture was not checked (a vision-language model: transformers "
                                          "renames its stored tensors as it loads them; the ranks will)")


@pytest.mark.parametrize("damage", ["truncated", "flipped length", "wrong shape"])
def test_a_damaged_safetensors_header_is_refused(tmp_path: Path, damage: str) -> None:
    from safetensors.torch import save_file

    path = tmp_path / "adapter_model.safetensors"
    save_file({"a": torch.zeros(4, 2), "b": torch.zeros(3)}, str(path))
    raw = bytearray(path.read_bytes())
    length = int.from_bytes(raw[:8], "little")
    if damage == "truncated":
        raw = raw[:-4]
    elif damage == "flipped length":
        raw[0] ^= 0x01
    else:
        raw[8:8 + length] = raw[8:8 + length].replace(b"[4,2]", b"[4,3]")
    path.write_bytes(bytes(raw))
    with pytest.raises(files.CheckpointError, match=str(path)):
        weights.check_safetensors(path)


def test_adapter_keys_must_match_the_target_modules(tmp_path: Path) -> None:
    path = tmp_path / "adapter_model.safetensors"
    good = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": 0,
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": 0}
    weights.check_adapter_keys(path, good, ["q_proj"])
    with pytest.raises(files.CheckpointError, match="not one of the target modules v_proj"):
        weights.check_adapter_keys(path, good, ["v_proj"])
    with pytest.raises(files.CheckpointError, match="has lora_A but not its other half"):
        weights.check_adapter_keys(path, dict(list(good.items())[:1]), ["q_proj"])
    with pytest.raises(files.CheckpointError, match="is not a LoRA A/B weight"):
        weights.check_adapter_keys(path, {"model.embed_tokens.weight": 0}, [])


def test_a_damaged_latest_is_refused_at_start_up_and_ckpt_step_picks_a_checkpoint(save_dir: Path,
                                                                                  tiny_model_dir: Path) -> None:
    (save_dir / ckpt.LATEST).write_bytes(b"\x00\xff garbage")
    flags = ["--hf-checkpoint", str(tiny_model_dir), *BASE, "--load", str(save_dir)]
    with pytest.raises(ConfigError, match=r"^--load: .*latest is damaged .* complete checkpoints: rollout 3: pick "
                                          r"one with --ckpt-step N \(e\.g\. --ckpt-step 3\)$"):
        preflight(parse_config(flags))
    notes = preflight(parse_config([*flags, "--ckpt-step", "3"]))
    assert f"--load: {save_dir / 'rollout_3'} verified (sizes, digests, metadata)" in notes
    with pytest.raises(ConfigError, match=r"--ckpt-step 9: --load .* holds no checkpoint rollout_9 \(it holds: 3\)"):
        parse_config([*flags, "--ckpt-step", "9"]).load_plan()
    with pytest.raises(ConfigError, match="--ckpt-step needs --load DIR"):
        parse_config(["--hf-checkpoint", str(tiny_model_dir), *BASE, "--ckpt-step", "3"])
    (save_dir / ckpt.LATEST).unlink()  # no `latest` at all: not a fresh start over the checkpoints it holds
    with pytest.raises(ConfigError, match=r"^--load: .*latest is missing; .* --ckpt-step 3\)$"):
        preflight(parse_config(flags))


def test_a_sharded_model_is_checked_file_by_file_against_its_index(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(2)}, str(tmp_path / "model-1.safetensors"))
    save_file({"b": torch.zeros(3)}, str(tmp_path / "model-2.safetensors"))
    index = tmp_path / weights.INDEX
    weight_map = {"a": "model-1.safetensors", "b": "model-2.safetensors"}
    index.write_text(json.dumps({"weight_map": weight_map}))
    assert set(weights.model_tensors(tmp_path)) == {"a", "b"}
    index.write_text(json.dumps({"weight_map": {**weight_map, "c": "model-2.safetensors"}}))
    with pytest.raises(files.CheckpointError, match=r"model-2\.safetensors: lacks c, which"):
        weights.model_tensors(tmp_path)
    index.write_text(json.dumps({"weight_map": {**weight_map, "c": "../model-3.safetensors"}}))
    with pytest.raises(files.CheckpointError, match=r"model-3\.safetensors: missing"):
        weights.model_tensors(tmp_path)
    index.write_text("[" * 10_000)
    with pytest.raises(files.CheckpointError, match="not a safetensors index"):
        weights.model_tensors(tmp_path)


# --- the drill matrix: every kind of file rayless reads, every kind of damage ---------------------------------

SPEC_Q = {"rank": 4, "alpha": 8.0, "target_modules": ("q_proj",)}
Q_PROJ = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def library(saved: Path, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One directory of each kind, written by rayless's own writers (never modified: tests copy them): a LoRA
    checkpoint (the real save plus its PEFT `adapter/`), an engine weight snapshot, a `--save-hf` / `rayless
    export` directory with its adapter, a plain Hugging Face model (no manifest) and a `--lora-adapter-path`."""
    from safetensors.torch import load_file

    from workers.protocol.train_settings import LoraSettings
    from workers.train_rank import lora, weight_export

    root = tmp_path_factory.mktemp("library")
    state = load_file(str(tiny_model_dir / "model.safetensors"))
    spec = LoraSettings(**SPEC_Q)  # type: ignore[arg-type]
    adapter = {f"{Q_PROJ}.lora_A.weight": torch.full((4, 64), 0.01), f"{Q_PROJ}.lora_B.weight": torch.zeros(64, 4)}

    def write_adapter(directory: Path) -> None:
        lora.write_adapter_files(adapter, spec, directory, base_model_path=str(tiny_model_dir))

    shutil.copytree(saved / "rollout_3", root / "checkpoint")
    write_adapter(root / "checkpoint" / "adapter")
    files.write_manifest(root / "checkpoint")
    snapshot = weight_export.write_snapshot(state, source_dir=tiny_model_dir, directory=root / "snapshots",
                                            weight_version="1", keep=1)
    weight_export.write_hf_directory(state, source_dir=tiny_model_dir, directory=root / "exported",
                                     write_extra=lambda d: write_adapter(d / "adapter"))
    shutil.copytree(tiny_model_dir, root / "plain")
    write_adapter(root / "adapter")
    return {"checkpoint": root / "checkpoint", "snapshot": snapshot, "exported": root / "exported",
            "plain": root / "plain", "adapter": root / "adapter"}


def _edit_tensors(path: Path, edit: Any) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _wrong_shape(path: Path) -> None:
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        name = next(n for n in tensors if n.endswith(("norm.weight", "lora_A.weight")))
        tensors[name] = torch.ones(tensors[name].shape[0] + 1, *tensors[name].shape[1:])

    _edit_tensors(path, edit)


def _wrong_dtype(path: Path) -> None:
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        name = next(n for n in tensors if n.endswith(("norm.weight", "lora_A.weight")))
        tensors[name] = tensors[name].to(torch.int32)

    _edit_tensors(path, edit)


#: damage → (what it does to the file, what the refusal says: any of these)
DAMAGES: dict[str, tuple[Any, tuple[str, ...]]] = {
    "truncated": (_truncate, ("truncated", "bytes, the manifest says", "too short", "header in a")),
    "flipped byte": (_flip, ("does not match the manifest's digest",)),
    "missing": (lambda p: p.unlink(), ("missing", "no model.safetensors")),
    "symlink out": (_symlink_out, ("points outside",)),
    "garbage JSON": (lambda p: p.write_text('{"r": '), ("not valid JSON",)),
    "deep JSON": (lambda p: p.write_text("[" * 100_000), ("nested deeper",)),
    "wrong shape": (_wrong_shape, ("needs [", "adapter of that layer is [")),
    "wrong dtype": (_wrong_dtype, ("is I32", "holds floating-point")),
}
#: (kind, file, damage, manifest rewritten to match: the file's own check must catch it). Where a kind has a
#: manifest, damage the manifest does not know of is caught there (size, digest, presence, symlink); with the
#: manifest rewritten (a hand-edited directory) the content check catches what it can.
MATRIX = [
    *[("checkpoint", name, damage, False) for name in ("__0_0.distcp", ".metadata", "extra.json", "scheduler.json",
                                                       "rng_rank0.json", "adapter/adapter_model.safetensors")
      for damage in ("truncated", "flipped byte", "missing", "symlink out")],
    *[("checkpoint", name, damage, True) for name in ("extra.json", "scheduler.json", "rng_rank0.json")
      for damage in ("garbage JSON", "deep JSON", "missing", "symlink out")],
    ("checkpoint", "__0_0.distcp", "truncated", True),
    ("checkpoint", "manifest.json", "garbage JSON", False),
    ("checkpoint", "manifest.json", "deep JSON", False),
    *[("snapshot", name, damage, False) for name in ("model.safetensors", "config.json")
      for damage in ("truncated", "flipped byte", "missing", "symlink out")],
    ("snapshot", "manifest.json", "garbage JSON", False),
    ("snapshot", "manifest.json", "deep JSON", False),
    *[("exported", name, damage, False) for name in ("model.safetensors", "config.json",
                                                     "adapter/adapter_model.safetensors")
      for damage in ("truncated", "flipped byte", "missing", "symlink out")],
    *[("exported", "model.safetensors", damage, True) for damage in ("truncated", "wrong shape", "wrong dtype")],
    *[("exported", "config.json", damage, True) for damage in ("garbage JSON", "deep JSON")],
    ("exported", "manifest.json", "garbage JSON", False),
    ("exported", "manifest.json", "deep JSON", False),
    *[("plain", "model.safetensors", damage, False) for damage in ("truncated", "missing", "wrong shape",
                                                                    "wrong dtype")],
    *[("plain", "config.json", damage, False) for damage in ("garbage JSON", "deep JSON", "missing")],
    *[("adapter", "adapter_model.safetensors", damage, False) for damage in ("truncated", "flipped byte",
                                                                             "missing", "symlink out")],
    *[("adapter", "adapter_model.safetensors", damage, True) for damage in ("truncated", "wrong shape",
                                                                            "wrong dtype")],
    *[("adapter", "adapter_config.json", damage, True) for damage in ("garbage JSON", "deep JSON")],
]


def _check(kind: str, directory: Path, model: Path) -> Any:
    """What reads a directory of this kind before it is used: the coordinator's preflight checks, and for a
    snapshot the engine's own check before it loads one."""
    from coordinator.checks.disk import verify_adapter, verify_model_dir
    from workers.engine.runner import ModelRunner

    if kind == "checkpoint":
        return files.verify_checkpoint(directory)
    if kind == "snapshot":
        return ModelRunner._check_manifest(directory)
    if kind == "adapter":
        return verify_adapter(parse_config(["--hf-checkpoint", str(model), *BASE, "--lora-adapter-path",
                                            str(directory)]), directory)
    return verify_model_dir(directory)


@pytest.mark.parametrize(("kind", "name", "damage", "remanifest"), MATRIX,
                         ids=[f"{k}:{n}:{d}{':remanifested' if r else ''}" for k, n, d, r in MATRIX])
def test_every_kind_of_file_damaged_every_way_is_refused_naming_it(library: dict[str, Path], tiny_model_dir: Path,
                                                                   tmp_path: Path, kind: str, name: str,
                                                                   damage: str, remanifest: bool) -> None:
    from workers.engine.runner import WeightUpdateError

    directory = tmp_path / kind
    shutil.copytree(library[kind], directory, symlinks=True)
    _check(kind, directory, tiny_model_dir)  # whole, it passes
    target = directory / name
    harm, said = DAMAGES[damage]
    harm(target)
    if remanifest:
        files.write_manifest(directory)
    with pytest.raises((files.CheckpointError, ConfigError, WeightUpdateError)) as refused:
        _check(kind, directory, tiny_model_dir)
    message = str(refused.value)
    assert str(target) in message or (f"{directory}: " in message and name in message), message
    assert any(words in message for words in said), message
    assert "\n" not in message


def test_a_plain_model_directory_may_hold_symlinks_and_a_flipped_weight_byte_is_what_no_header_shows(
        library: dict[str, Path], tiny_model_dir: Path, tmp_path: Path) -> None:
    """The two limits of a directory without a manifest (a Hugging Face download): its files may be symlinks
    anywhere (the Hub cache links snapshots to ../../blobs), and a byte flipped inside a tensor passes every
    header check (only a digest sees it: rayless's own directories carry one)."""
    from coordinator.checks.disk import verify_model_dir

    directory = tmp_path / "plain"
    shutil.copytree(library["plain"], directory)
    _symlink_out(directory / "model.safetensors")
    assert "headers and sizes" in verify_model_dir(directory)
    data = bytearray((directory / "model.safetensors").read_bytes())
    data[-100] ^= 0x01
    (directory / "model.safetensors").unlink()
    (directory / "model.safetensors").write_bytes(bytes(data))
    assert "headers and sizes" in verify_model_dir(directory)


def test_an_export_fetched_into_the_hub_cache_verifies_through_its_blob_links(library: dict[str, Path],
                                                                              tmp_path: Path) -> None:
    """A `--save-hf` directory uploaded and downloaded again sits in the Hugging Face cache: its files are
    symlinks from `snapshots/<revision>/` to `../../blobs/`; its manifest still verifies, and a link out of that
    repository is still refused."""
    from coordinator.checks.disk import verify_model_dir

    repo = tmp_path / "models--me--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for path in sorted(library["exported"].rglob("*")):
        if path.is_file():
            name = path.relative_to(library["exported"])
            blob = repo / "blobs" / str(name).replace("/", "-")
            shutil.copy(path, blob)
            (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
            (snapshot / name).symlink_to(os.path.relpath(blob, (snapshot / name).parent))
    assert "manifest.json's sizes and digests" in verify_model_dir(snapshot)
    elsewhere = tmp_path / "elsewhere.json"  # the same bytes, outside the repository
    shutil.copy(snapshot / "config.json", elsewhere)
    (snapshot / "config.json").unlink()
    (snapshot / "config.json").symlink_to(elsewhere)
    with pytest.raises(files.CheckpointError, match=f"{snapshot / 'config.json'}: points outside {repo}"):
        verify_model_dir(snapshot)
