"""Real slime/miles launch scripts as test data, made runnable here by replacing only their paths.

`tests/data/launch_scripts/*.json` hold the argv 64 slime and miles launch scripts hand to `train.py` (each
with `source`: repo:path@commit), with placeholders where the scripts name paths on their machines.
`materialize` replaces each placeholder with a local stand-in — the tiny model, small JSONL/Parquet files with
the script's keys, fresh checkpoint directories (`DIR:name`: a path the script writes to), stub hook modules with
slime's signatures, a sentinel W&B key — and nothing else. `validate_launch_argv` runs `rayless train ARGV` up to
the point where it would launch (`--dry-run` where the CLI has it; else the real CLI with the launch step replaced
by an exit 0), in a child process, and returns its exit status and output.

`PENDING` lists the flags and values these scripts use that rayless does not have yet (they are refused with exit 2
today), `UNSUPPORTED` those rayless refuses by design, each with why; `blockers` finds them in an argv, read
against the parser and reward registry of this tree, so the scripts test tightens by itself as they land.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.warm_cli import WarmCli

SCRIPTS_DIR = Path(__file__).resolve().parents[1] / "data" / "launch_scripts"
WANDB_SENTINEL = "wandb-sentinel-3f9c2b7e1d"
ROOT = Path(__file__).resolve().parents[2]

#: Flags not added yet (refused with exit 2 naming them); a flag the parser learns drops out of `blockers`.
PENDING: dict[str, str] = {}
#: `--rm-type` values that the reward-types issue adds (issue 13 item 3).
PENDING_RM_TYPES = "not yet: a reward type rayless does not have"
#: Flags and values rayless refuses by design.
UNSUPPORTED = {
    "--enable-mtp-training": "multi-token-prediction layers are not trained",
}
#: Scripts whose flags are all known but whose combination a start-up rule refuses (exit 2), each with the words
#: the refusal must say: a feature not built for that combination, named.
REFUSED_COMBINATIONS: dict[str, str] = {}

#: Scripts that validate with no notice about their flags: every one taken as it is (no Megatron flag, nothing
#: ignored or mapped), each with why.
QUIET_SCRIPTS = {
    "miles__qwen3_vl_4B_fsdp": "miles' FSDP CI recipe for Qwen3-VL: FSDP flags only, each implemented",
}

#: Scripts whose notice names only mapped flags: no Megatron-LM flag to ignore, each with why.
MAPPED_ONLY_SCRIPTS = {
    "miles__run_qwen3_0_6b_fsdp": "miles' FSDP launcher: --use-dynamic-batch-size and --balance-data mapped",
    "miles__run_nemotron_3_nano_4b_fsdp": "miles' FSDP launcher: --use-dynamic-batch-size and --balance-data mapped",
    "miles__run_mcore_fsdp": "miles' launcher in its FSDP mode (the snapshot's default): mapped flags only",
}

@dataclass(frozen=True)
class LaunchScript:
    name: str
    source: str
    argv: tuple[str, ...]
    placeholders: dict[str, Any]

    @classmethod
    def load(cls, path: Path) -> LaunchScript:
        data = json.loads(path.read_text())
        return cls(name=path.stem, source=data["source"], argv=tuple(data["argv"]),
                   placeholders=data["placeholders"])

    def value(self, flag: str) -> str | None:
        argv = list(self.argv)
        return argv[argv.index(flag) + 1] if flag in argv else None


def all_scripts() -> list[LaunchScript]:
    return [LaunchScript.load(path) for path in sorted(SCRIPTS_DIR.glob("*.json"))]


# ---------------------------------------------------------------------------------------------------------
# What blocks a script today
# ---------------------------------------------------------------------------------------------------------
def flags_of(argv: list[str] | tuple[str, ...]) -> list[str]:
    return [token for token in argv if token.startswith("--") and not token[2:3].isdigit()]


def blockers(argv: list[str] | tuple[str, ...]) -> dict[str, str]:
    """Flags (and `--rm-type`/`--advantage-estimator` values) of `argv` this tree refuses, with why: pending
    (another issue adds it) or unsupported. Read from the parser and registries, not from a list of ours."""
    from coordinator.config.parser import known_flags
    from coordinator.config.upstream_args import parser_rows
    from coordinator.rollout.rewards import BUILTIN_RM_TYPES

    known = set(known_flags())
    table = {row.flag: row for row in parser_rows(known)}
    found: dict[str, str] = {}
    for flag in flags_of(argv):
        if flag in known or flag.startswith("--sglang-") or (flag in table and table[flag].disposition != "refused"):
            continue
        if flag in table:  # refused by the flag table, naming the feature and why
            UNSUPPORTED.setdefault(flag, table[flag].note)
        found[flag] = PENDING.get(flag) or UNSUPPORTED.get(flag) or "UNEXPECTED: neither pending nor unsupported"
    argv = list(argv)
    if "--rm-type" in argv:
        rm_type = argv[argv.index("--rm-type") + 1]
        if rm_type not in BUILTIN_RM_TYPES:
            found[f"--rm-type {rm_type}"] = PENDING_RM_TYPES
    if "--advantage-estimator" in argv:
        key = f"--advantage-estimator {argv[argv.index('--advantage-estimator') + 1]}"
        if key in UNSUPPORTED:
            found[key] = UNSUPPORTED[key]
    return found


def without_pending(argv: list[str]) -> list[str]:
    """`argv` with the pending flags (and their values) removed, so everything else in it can be checked today.

    A pending `--rm-type` changes meaning when dropped, so it is replaced by `math` (a reward this tree has).
    """
    from coordinator.rollout.rewards import BUILTIN_RM_TYPES

    pending = {flag for flag, why in blockers(argv).items() if why.startswith(("issue", "not yet"))}
    result: list[str] = []
    skipping = False
    for token in argv:
        if token.startswith("--") and not token[2:3].isdigit():
            skipping = token in pending
        if not skipping:
            result.append(token)
    if "--rm-type" in result and result[result.index("--rm-type") + 1] not in BUILTIN_RM_TYPES:
        result[result.index("--rm-type") + 1] = "math"
    return result


# ---------------------------------------------------------------------------------------------------------
# Local stand-ins for the paths
# ---------------------------------------------------------------------------------------------------------
_HOOK_STUBS = {
    # slime: async generate(args, sample, sampling_params, evaluation=False) -> Sample | list[Sample]
    "generate": "async def {name}(args, sample, sampling_params, evaluation=False):\n",
    "generate_with_multi_agents": "async def {name}(args, sample, sampling_params, evaluation=False):\n",
    # slime: async reward_func(args, sample, **kwargs) -> float | dict
    "reward_func": "async def {name}(args, sample, **kwargs):\n",
    # miles multi_turn: async execute_tool(name, params) -> str
    "execute_tool": "async def {name}(name, params):\n",
    # slime: fn(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs)
    "compute_mis_weights_with_cp": "def {name}(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, "
                                   "**kwargs):\n",
}
_STUB_BODY = "    raise NotImplementedError('stand-in for a slime/miles example hook; a dry run never calls it')\n"


def write_hook_stub(root: Path, module: str, attribute: str) -> None:
    """`root/<module as path>.py` defining `attribute` with the signature slime calls it with."""
    parts = module.split(".")
    directory = root.joinpath(*parts[:-1])
    directory.mkdir(parents=True, exist_ok=True)
    for depth in range(1, len(parts)):
        init = root.joinpath(*parts[:depth], "__init__.py")
        if not init.exists():
            init.write_text("")
    path = directory / f"{parts[-1]}.py"
    text = path.read_text() if path.exists() else '"""Stand-in for a slime/miles example module (scripts test)."""\n'
    if attribute == "tool_specs":
        text += "\ntool_specs = [{'type': 'function', 'function': {'name': 'code_interpreter', 'parameters': {}}}]\n"
    else:
        text += "\n\n" + _HOOK_STUBS[attribute].format(name=attribute) + _STUB_BODY
    path.write_text(text)


def write_prompts(path: Path, *, input_key: str, label_key: str | None, rows: int = 4,
                  image_key: str | None = None, metadata_key: str | None = None) -> Path:
    """A few prompts with the script's keys: chat messages (or a task index for an `index` key) and a label.

    tau-bench's `index` prompts are ints, read by its custom generate function (slime keeps the raw value).
    `image_key` (a script's `--multimodal-keys` column): geo3k's shape, a text prompt holding `<image>` and one
    image per row, as PNG bytes in Parquet (`{"bytes", "path"}`, as geo3k ships them) or a path relative to a
    JSONL file. `metadata_key` (a script's `--metadata-key`): a small dict per row, as SWE-style data carries."""
    from tests.support.hostile_images import solid_png

    records = []
    for index in range(rows):
        record: dict[str, Any] = {input_key: index if input_key == "index" else
                                  [{"role": "user", "content": f"What is {index} + {index}?"}]}
        if image_key is not None:
            record[input_key] = f"<image>What is {index} + {index} in this figure?"
            if input_key == "messages":  # an SFT chat (miles' geo3k train_formatted): the answer is its last turn
                record[input_key] = [{"role": "user", "content": record[input_key]},
                                     {"role": "assistant", "content": str(2 * index)}]
            picture = solid_png(56, 56, (40 * index, 0, 0))
            if path.suffix == ".parquet":
                record[image_key] = [{"bytes": picture, "path": None}]
            else:
                (path.parent / f"{path.stem}-{index}.png").write_bytes(picture)
                record[image_key] = [f"{path.stem}-{index}.png"]
        if label_key is not None:
            record[label_key] = str(2 * index)
        if metadata_key is not None:
            record[metadata_key] = {"instance_id": f"task-{index}"}
        records.append(record)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist([{k: json.dumps(v) if isinstance(v, list) and k != image_key else v
                                              for k, v in record.items()} for record in records]), path)
    else:
        path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def write_eval_config(workdir: Path, hooks: Path, yaml_text: str, *, input_key: str, label_key: str | None) -> Path:
    """The script's `--eval-config` YAML with each dataset's `path` replaced by a small local JSONL holding the
    dataset's keys (its own `input_key`/`label_key` when it names them); an `ifbench` dataset also gets the
    stand-in `evaluation_lib` on the hooks path (start-up checks that IFBench is importable)."""
    import yaml

    config = yaml.safe_load(yaml_text) or {}
    datasets = (config.get("eval") or {}).get("datasets") or []
    entries = datasets.values() if isinstance(datasets, dict) else datasets
    for index, dataset in enumerate(entries):
        name = str(dataset.get("name") or index)
        dataset["path"] = str(write_prompts(workdir / f"eval_{name}.jsonl",
                                            input_key=dataset.get("input_key") or input_key,
                                            label_key=dataset.get("label_key") or label_key or "label"))
        if dataset.get("rm_type") == "ifbench":
            (hooks / "evaluation_lib.py").write_text(
                '"""Stand-in for IFBench\'s evaluation_lib: the scripts test only needs start-up\'s import check '
                'to pass; a dry run never scores."""\n')
    path = workdir / "eval_config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def materialize(script: LaunchScript, workdir: Path, model_dir: Path,
                vlm_dir: Path | None = None) -> tuple[list[str], Path]:
    """The script's argv with every placeholder replaced by a local stand-in; returns it and the directory of
    stub modules to put on PYTHONPATH. A script with `--multimodal-keys` gets `vlm_dir` (a tiny VLM) as its
    model and prompts holding images."""
    hooks = workdir / "hooks"
    hooks.mkdir(parents=True, exist_ok=True)
    input_key = script.value("--input-key") or "input"
    label_key = script.value("--label-key")
    metadata_key = script.value("--metadata-key")
    keys = script.value("--multimodal-keys")
    image_key = json.loads(keys).get("image") if keys else None
    if image_key is not None and vlm_dir is not None:
        model_dir = vlm_dir
    replacements: dict[str, str] = {}
    for token, info in script.placeholders.items():
        original = str(info.get("original", ""))
        if token == "HF_CHECKPOINT" or token == "REF_LOAD":
            value = str(model_dir)
        elif token == "SAVE_DIR":
            value = str(workdir / "checkpoints")
        elif token == "LOAD_DIR":
            # The same not-yet-existing directory as --save; miles' base-model torch_dist → the HF model itself.
            value = str(workdir / "checkpoints") if info.get("same_as") == "SAVE_DIR" or "{SAVE_DIR}" in original \
                or "does not exist" in info.get("must_be", "") else str(model_dir)
        elif token == "PROMPT_DATA":
            suffix = ".parquet" if original.endswith(".parquet") else ".jsonl"
            value = str(write_prompts(workdir / f"train{suffix}", input_key=input_key, label_key=label_key,
                                      image_key=image_key, metadata_key=metadata_key))
        elif token.startswith("EVAL_DATA:"):  # eval reads --eval-input-key / --eval-label-key where given
            suffix = ".parquet" if original.endswith(".parquet") else ".jsonl"
            value = str(write_prompts(workdir / f"{token.split(':', 1)[1]}{suffix}",
                                      input_key=script.value("--eval-input-key") or input_key,
                                      label_key=script.value("--eval-label-key") or label_key, image_key=image_key))
        elif token == "EVAL_CONFIG":
            value = str(write_eval_config(workdir, hooks, info.get("yaml_text") or "{}\n",
                                          input_key=script.value("--eval-input-key") or input_key,
                                          label_key=script.value("--eval-label-key") or label_key))
        elif token in ("CUSTOM_CONFIG", "SGLANG_CONFIG"):
            path = workdir / f"{token.lower()}.yaml"
            path.write_text(info.get("yaml_text") or "{}\n")
            value = str(path)
        elif token in ("DUMP_DETAILS_DIR", "EVAL_HF_DIR"):
            value = str(workdir / token.lower())
        elif token.startswith("DIR:"):  # a path the script writes to (a dump, a weight-update directory)
            value = str(workdir / token.split(":", 1)[1])
        elif token == "WANDB_KEY":
            value = WANDB_SENTINEL
        elif token == "RUN_ID":
            value = "run-0"
        elif token.startswith("HOOK:"):
            _, module, attribute = token.split(":")
            write_hook_stub(hooks, module, attribute)
            value = f"{module}.{attribute}"
        else:
            raise KeyError(f"{script.name}: no stand-in for placeholder {token!r}")
        replacements["{" + token + "}"] = value
    argv = []
    for token in script.argv:
        for placeholder, value in replacements.items():
            token = token.replace(placeholder, value)
        if "{" in token and "}" in token and any(f"{{{name}" in token for name in ("HOOK", "EVAL", "HF_", "LOAD")):
            raise KeyError(f"{script.name}: placeholder left in {token!r}")
        argv.append(token)
    return argv, hooks


def wandb_stand_in(workdir: Path) -> Path | None:
    """A directory holding importable `wandb` / `tensorboard` stand-ins for those not installed, or None when
    both are.

    `--use-wandb` / `--use-tensorboard` make start-up check that the package is installed; the dry run never
    logs, so where one is not installed its stand-in (named as such) lets that check pass. A real run with it
    would fail at once.
    """
    import importlib.util

    missing = [name for name in ("wandb", "tensorboard") if importlib.util.find_spec(name) is None]
    if not missing:
        return None
    for name in missing:
        package = workdir / "stand_ins" / name
        package.mkdir(parents=True, exist_ok=True)
        (package / "__init__.py").write_text(f'"""Stand-in: the scripts test only needs --use-{name}\'s install '
                                             'check to pass; nothing here logs."""\n')
    return workdir / "stand_ins"


# ---------------------------------------------------------------------------------------------------------
# Running the CLI up to the launch
# ---------------------------------------------------------------------------------------------------------
def validate_launch_argv(argv: list[str], *, cwd: Path, python_path: list[Path] = (),
                         timeout: float = 120.0, warm: WarmCli | None = None) -> tuple[int, str, str]:
    """`rayless train ARGV --dry-run`: everything before the launch (parse, preflight, notices), nothing launched.
    With `warm`, the dry run is a child forked from a server that has imported transformers already."""
    if warm is not None:
        return warm.run(["train", *argv, "--dry-run"], cwd=cwd, python_path=list(python_path), timeout=timeout)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*(str(p) for p in python_path), str(ROOT), env.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "coordinator.cli", "train", *argv, "--dry-run"]
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    return done.returncode, done.stdout, done.stderr


def notices(stderr: str) -> list[str]:
    """The notices and warnings `rayless train` printed (each starts a line with `rayless train: <kind>:`)."""
    return [line for line in stderr.splitlines() if line.startswith(("rayless train: notice:",
                                                                     "rayless train: warning:"))]
