"""Start-up validation through the real CLI, as a subprocess: exit 2, the flags named, nothing launched (no
child process, neither the launcher nor torch imported)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# The same base flags as tests/unit/test_config.py ("/model" is replaced where a test needs a real directory).
BASE = ["--hf-checkpoint", "/model", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
        "--num-rollout", "3", "--prompt-data", "builtin:first_digit"]


PROBE = textwrap.dedent(
    """
    import json, sys, psutil
    from coordinator.cli import main
    status = main(sys.argv[1:])
    print(json.dumps({
        "status": status,
        "children": len(psutil.Process().children(recursive=True)),
        "launcher_imported": "coordinator.run" in sys.modules,
        "torch_imported": "torch" in sys.modules,
    }))
    """
)


def run_cli(*args: str) -> tuple[dict, str]:
    result = subprocess.run([sys.executable, "-c", PROBE, "train", *args], capture_output=True, text=True,
                            timeout=60, check=False)
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--rollout-num-engines", "1", "--load-debug-rollout-data", "d/{rollout_id}", "--debug-rollout-only"],
         ["--load-debug-rollout-data", "--debug-rollout-only"]),
        (["--load-debug-rollout-data", "d/{rollout_id}", "--eval-num-engines", "1"],
         ["--load-debug-rollout-data", "--eval-num-engines"]),
        (["--rollout-num-gpus", "3", "--rollout-num-gpus-per-engine", "2"],
         ["--rollout-num-gpus", "--rollout-num-gpus-per-engine"]),
        (["--rollout-num-engines", "1", "--use-fault-tolerance", "--ft-components", "rollout,trian"],
         ["--ft-components", "trian"]),
        ([], ["--rollout-num-engines", "--rollout-external-engine-addrs", "--debug-train-only"]),
        (["--load-debug-rollout-data", "dumps/rollout.rld"], ["--load-debug-rollout-data", "{rollout_id}"]),
        (["--rollout-num-engines", "1", "--rollout-batch-size", "0"], ["--rollout-batch-size"]),
        (["--rollout-num-engines", "1", "--n-samples-per-prompt", "-1"], ["--n-samples-per-prompt"]),
        (["--rollout-num-engines", "1", "--global-batch-size", "3"],
         ["--global-batch-size", "--rollout-batch-size", "--n-samples-per-prompt"]),
        (["--rollout-num-engines", "1", "--debug-train-only", "--debug-rollout-only"],
         ["--debug-train-only", "--debug-rollout-only"]),
    ],
    ids=["replay+rollout-only", "replay+eval-fleet", "gpus-not-divisible", "unknown-ft-component",
         "no-engines", "template-without-rollout-id", "zero-batch", "negative-n-samples",
         "global-batch-not-dividing", "train-only+rollout-only"],
)
def test_contradictory_flags_exit_2_naming_flags_before_launching(flags: list[str], named: list[str]) -> None:
    outcome, stderr = run_cli(*BASE, *flags)
    assert outcome["status"] == 2, stderr
    for flag in named:
        assert flag in stderr, (flag, stderr)
    assert outcome["children"] == 0
    assert not outcome["launcher_imported"] and not outcome["torch_imported"]


def test_missing_model_directory_is_reported_before_launching(tmp_path: Path) -> None:
    outcome, stderr = run_cli(*[a if a != "/model" else str(tmp_path / "nope") for a in BASE],
                              "--rollout-num-engines", "1")
    assert outcome["status"] == 2 and "--hf-checkpoint" in stderr and "make-tiny-model" in stderr
    assert outcome["children"] == 0 and not outcome["launcher_imported"]


def test_asking_for_a_metrics_backend_that_is_not_installed_fails_before_launching(tiny_model_dir: Path) -> None:
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here, so --use-wandb is valid")  # CI installs no wandb
    args = [a if a != "/model" else str(tiny_model_dir) for a in BASE]
    outcome, stderr = run_cli(*args, "--rollout-num-engines", "1", "--use-wandb")
    assert outcome["status"] == 2 and "--use-wandb" in stderr and "pip install wandb" in stderr
    assert outcome["children"] == 0 and not outcome["launcher_imported"]


# One interpreter for many command lines (each case would otherwise pay ~1 s of start-up): the same checks per
# case — exit 2, the flag or key named — and, after every case, no child process and neither the launcher
# nor torch imported.
BATCH_PROBE = textwrap.dedent(
    """
    import contextlib, io, json, sys, psutil
    from coordinator.cli import main
    results = []
    for argv in json.loads(sys.stdin.read()):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            status = main(argv)
        results.append({
            "status": status, "stderr": err.getvalue(),
            "children": len(psutil.Process().children(recursive=True)),
            "launcher_imported": "coordinator.run" in sys.modules,
            "torch_imported": "torch" in sys.modules,
        })
    print(json.dumps(results))
    """
)


def run_cli_batch(cases: list[list[str]]) -> list[dict]:
    result = subprocess.run([sys.executable, "-c", BATCH_PROBE], input=json.dumps([["train", *c] for c in cases]),
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def assert_refused(cases: list[tuple[list[str], list[str]]], base: list[str]) -> None:
    outcomes = run_cli_batch([[*base, *flags] for flags, _ in cases])
    for (flags, named), outcome in zip(cases, outcomes, strict=True):
        assert outcome["status"] == 2, (flags, outcome["stderr"])
        for text in named:
            assert text in outcome["stderr"], (flags, text, outcome["stderr"])
        assert outcome["stderr"].startswith("rayless train: error: ") and "Traceback" not in outcome["stderr"]
        assert outcome["children"] == 0, flags
        assert not outcome["launcher_imported"] and not outcome["torch_imported"], flags


def test_values_out_of_type_or_range_exit_2_naming_the_flag_before_launching(tiny_model_dir: Path) -> None:
    base = [a if a != "/model" else str(tiny_model_dir) for a in BASE] + ["--rollout-num-engines", "1"]
    assert_refused([
        (["--rollout-temperature", "nan"], ["--rollout-temperature", "finite"]),
        (["--rollout-top-k", "0"], ["--rollout-top-k", "≥ 1 or -1"]),
        (["--lr", "-1"], ["--lr", "≥ 0"]),
        (["--lr", "nan"], ["--lr", "finite"]),
        (["--save", "ckpt", "--save-interval", "0"], ["--save-interval"]),
        (["--rollout-health-check-interval", "0"], ["--rollout-health-check-interval"]),
        (["--keep-weight-snapshots", "0"], ["--keep-weight-snapshots"]),
        (["--rollout-external-engine-addrs", "not an address"], ["--rollout-external-engine-addrs", "not an address"]),
        (["--rollout-num-engines", "-1"], ["--rollout-num-engines"]),
        (["--control-port", "70000"], ["--control-port", "65535"]),
        (["--rm-type", "bogus"], ["--rm-type", "bogus", "exact_match"]),
        (["--rollout-external", "127.0.0.1:1"], ["--rollout-external", "--rollout-external-engine-addrs"]),
    ], base)


def test_config_files_with_wrong_types_exit_2_naming_the_key(tiny_model_dir: Path, tmp_path: Path) -> None:
    base = [a if a != "/model" else str(tiny_model_dir) for a in BASE] + ["--rollout-num-engines", "1"]
    cases = []
    for index, (text, named) in enumerate([
        ("rollout-batch-size: abc\n", ["'rollout-batch-size'", "integer"]),
        ("rm-type: bogus\n", ["'rm-type'", "bogus"]),
        ("ft_components: null\n", ["'ft_components'", "null"]),
        ("lr: .nan\n", ["'lr'", "finite"]),
        ("rollout_external_engine_addrs: [127.0.0.1]\n", ["'rollout_external_engine_addrs'", "not an address"]),
    ]):
        path = tmp_path / f"job{index}.yaml"
        path.write_text(text)
        cases.append((["--config", str(path)], [str(path), *named]))
    assert_refused(cases, [a for a in base if a not in ("--rollout-batch-size", "4")])


def test_hook_paths_are_resolved_before_launching(tiny_model_dir: Path) -> None:
    base = [a if a != "/model" else str(tiny_model_dir) for a in BASE] + ["--rollout-num-engines", "1"]
    assert_refused([
        (["--rollout-function-path", "no_such_module_here:Rollout"],
         ["--rollout-function-path", "no_such_module_here", "not found"]),
        (["--eval-function-path", "coordinator.rollout.generate:NoSuchRollout"],
         ["--eval-function-path", "has no attribute 'NoSuchRollout'"]),
        (["--custom-rm-path", "coordinator.rewards.rules:FIRST_DIGIT_WINDOW"],
         ["--custom-rm-path", "names a int, not a function or class"]),
        (["--dynamic-sampling-filter-path", "coordinator.rollout.filters:no_such_filter"],
         ["--dynamic-sampling-filter-path", "no_such_filter"]),
    ], base)


def test_secrets_on_the_command_line_are_never_echoed_in_errors(tiny_model_dir: Path) -> None:
    base = [a if a != "/model" else str(tiny_model_dir) for a in BASE] + ["--rollout-num-engines", "1"]
    secrets = ["--wandb-key", "SENTINEL-W", "--sglang-api-key", "SENTINEL-S", "--sglang-hf-token", "SENTINEL-H"]
    outcomes = run_cli_batch([
        [*base, *secrets, "--custom-loss-function-path", "x", "--my-secret-token", "SENTINEL-U"],
        [*base, *secrets, "--lr", "nan"],
        [*base, "--wandb-key", "SENTINEL-W", "--wandb-key"],
    ])
    for outcome in outcomes:
        assert outcome["status"] == 2 and "SENTINEL" not in outcome["stderr"], outcome["stderr"]
    assert "--custom-loss-function-path" in outcomes[0]["stderr"] and "\n" in outcomes[0]["stderr"].strip()


def test_no_secret_reaches_any_output_or_file_of_a_run(tiny_model_dir: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "train", "--hf-checkpoint", str(tiny_model_dir), "--prompt-data",
         "builtin:first_digit", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "1",
         "--rollout-num-engines", "1", "--rollout-max-response-len", "4", "--no-progress", "--run-dir", str(run_dir),
         "--sglang-api-key", "SENTINEL-API-KEY", "--wandb-key", "SENTINEL-WANDB-KEY"],
        capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "SENTINEL" not in result.stdout + result.stderr
    leaks = [str(path) for path in run_dir.rglob("*") if path.is_file() and b"SENTINEL" in path.read_bytes()]
    assert leaks == []
    assert json.loads((run_dir / "config.json").read_text())["sglang_api_key"] == "***"
    engine_logs = list(run_dir.rglob("engine-*.log"))
    started = engine_logs[0].read_text() if engine_logs else ""
    # the key reached the engine in a 0600 file its command line names, never on the command line itself
    assert "--config /" in started and "rayless-secrets-" in started and "--api-key" not in started, started[:2000]


def test_contradictory_sft_runs_exit_2_naming_the_flags_before_launching(tiny_model_dir: Path,
                                                                          tmp_path: Path) -> None:
    """slime's SFT flags with what cannot mean anything in an SFT run, and chat data a template cannot render
    (one process for all cases)."""
    chats = tmp_path / "chats.jsonl"
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    chats.write_text("\n".join(json.dumps(row) for row in (good, {"messages": [{"role": "user", "content": 7}]},
                                                             good, {"messages": [{"role": "human", "content": "q"}]})))
    base = ["--hf-checkpoint", str(tiny_model_dir), "--rollout-batch-size", "4", "--num-rollout", "3",
            "--prompt-data", "builtin:first_digit"]
    sft = ["--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout", "--loss-type", "sft_loss"]
    assert_refused([
        ([*sft, "--rollout-num-engines", "2", "--use-sglang-router"],
         ["--loss-type sft_loss", "--rollout-num-engines, --use-sglang-router", "cannot mean anything"]),
        ([*sft, "--use-kl-loss", "--use-tis"], ["--use-kl-loss, --use-tis: terms of the policy loss"]),
        ([*sft[:2], "--debug-train-only"], ["slime.rollout.sft_rollout.generate_rollout", "add --loss-type sft_loss"]),
        ([*sft, "--n-samples-per-prompt", "4"], ["--n-samples-per-prompt 4", "one sample per chat"]),
        ([*sft, "--loss-type", "custom_loss"], ["--loss-type custom_loss", "refused"]),
        ([*sft, "--prompt-data", str(chats), "--input-key", "messages"],
         [f"--prompt-data: {chats}:2: input key 'messages'", "content of type int", "and 1 further bad line"]),
    ], base)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # the checkpoint written here
def test_no_run_with_a_damaged_model_or_adapter_starts(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Issue 39's drill through the CLI: a model cut to 4 KiB, a model lacking a parameter, a truncated
    `--lora-adapter-path` and a `--load` checkpoint whose adapter was cut: each exits 2 with one line naming the
    file, before anything is launched."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from tests.unit.test_checkpoint import save
    from workers.protocol.train_settings import LoraSettings
    from workers.train_rank import checkpoint_files, lora

    def model_copy(name: str) -> Path:
        return Path(shutil.copytree(tiny_model_dir, tmp_path / name))

    cut = model_copy("cut") / "model.safetensors"
    with cut.open("r+b") as handle:
        handle.truncate(4096)
    lacking = model_copy("lacking") / "model.safetensors"
    tensors = load_file(str(lacking))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(lacking), metadata={"format": "pt"})
    q_proj = "base_model.model.model.layers.0.self_attn.q_proj"
    spec = LoraSettings(rank=4, alpha=8.0, target_modules=("q_proj",))
    adapter = {f"{q_proj}.lora_A.weight": torch.ones(4, 64), f"{q_proj}.lora_B.weight": torch.ones(64, 4)}
    adapter_dir = tmp_path / "adapter"
    lora.write_adapter_files(adapter, spec, adapter_dir, base_model_path=str(tiny_model_dir))
    (adapter_dir / lora.ADAPTER_WEIGHTS).write_bytes((adapter_dir / lora.ADAPTER_WEIGHTS).read_bytes()[:-64])
    checkpoint = save(tmp_path / "save", 3, 1.0)
    lora.write_adapter_files(adapter, spec, checkpoint / lora.ADAPTER_DIR, base_model_path=str(tiny_model_dir))
    checkpoint_files.write_manifest(checkpoint)
    saved_adapter = checkpoint / lora.ADAPTER_DIR / lora.ADAPTER_WEIGHTS
    saved_adapter.write_bytes(saved_adapter.read_bytes()[:100])

    def flags(model: Path, *more: str) -> list[str]:
        return [*[a if a != "/model" else str(model) for a in BASE], "--rollout-num-engines", "1", *more]

    cases = [
        (flags(cut.parent), f"--hf-checkpoint: {cut}: 4096 bytes, the header describes"),
        (flags(tiny_model_dir, "--lora-adapter-path", str(adapter_dir)),
         f"--lora-adapter-path: {adapter_dir / lora.ADAPTER_WEIGHTS}:"),
        (flags(tiny_model_dir, "--load", str(tmp_path / "save")),
         f"--load: {saved_adapter}: 100 bytes, the manifest says"),
        (flags(lacking.parent), f"--hf-checkpoint: {lacking}: lacks 1 of the 25 tensors the model's config.json "
                                "needs: model.layers.1.mlp.down_proj.weight"),
    ]
    outcomes = run_cli_batch([argv for argv, _ in cases])
    for (_, said), outcome in zip(cases, outcomes, strict=True):
        assert outcome["status"] == 2 and outcome["stderr"].startswith(f"rayless train: error: {said}"), outcome
        assert outcome["stderr"].count("\n") == 1, outcome  # one line
        assert outcome["children"] == 0 and not outcome["launcher_imported"], outcome
    assert not outcomes[0]["torch_imported"]  # a cut model is refused from its header alone

