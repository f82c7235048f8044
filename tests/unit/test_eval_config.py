"""`--eval-config` (slime's eval YAML, a file or miles' `base64:`), the eval flags, and how each eval dataset's
settings are resolved (dataset > defaults > eval flag > rollout flag) and checked at start-up."""

from __future__ import annotations

import base64
import json
import warnings
from pathlib import Path

import pytest

from coordinator.checks.preflight import check_paths, check_rewards
from coordinator.config import ConfigError, ConfigWarning, parse_config
from coordinator.config.eval_file import read_eval_config
from coordinator.eval.settings import EvalSettings, load_eval_datasets

SLIME_MULTI_TASK = """\
eval:
  defaults:
    max_response_len: 16384
    top_p: 0.7
  datasets:
    - name: aime
      path: {aime}
      rm_type: deepscaler
      n_samples_per_eval_prompt: 16
    - name: gpqa    # a comment, as in slime's file
      path: {gpqa}
      rm_type: gpqa
      n_samples_per_eval_prompt: 2
      temperature: 0.6
"""

BASE = ["--hf-checkpoint", "/m", "--rollout-num-engines", "1", "--prompt-data", "builtin:first_digit",
        "--num-rollout", "2", "--rollout-batch-size", "1", "--rollout-temperature", "0.9", "--rollout-top-k", "20",
        "--rollout-max-response-len", "64"]


def write(tmp_path: Path, text: str, name: str = "eval.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def data_files(tmp_path: Path) -> dict[str, str]:
    aime = tmp_path / "aime.jsonl"
    aime.write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")
    gpqa = tmp_path / "gpqa.jsonl"
    gpqa.write_text(json.dumps({"prompt": "Pick", "label": "B", "metadata": {"choices": ["a", "b"]}}) + "\n")
    return {"aime": str(aime), "gpqa": str(gpqa)}


def settings_of(*argv: str) -> EvalSettings:
    config = parse_config([*BASE, *argv])
    return EvalSettings.from_slices(config.eval, rollout=config.rollout, sglang=config.sglang)


def test_slimes_multi_task_file_and_its_base64_form_give_the_same_datasets(tmp_path: Path) -> None:
    text = SLIME_MULTI_TASK.format(**data_files(tmp_path))
    from_file = read_eval_config(str(write(tmp_path, text)))
    from_base64 = read_eval_config("base64:" + base64.b64encode(text.encode()).decode())
    assert from_file == from_base64
    aime, gpqa = from_file
    assert (aime.name, aime.rm_type, aime.n_samples_per_eval_prompt, aime.max_response_len, aime.top_p) == (
        "aime", "deepscaler", 16, 16384, 0.7)
    assert (gpqa.name, gpqa.rm_type, gpqa.temperature, gpqa.top_p, gpqa.top_k) == ("gpqa", "gpqa", 0.6, 0.7, None)


def test_values_resolve_dataset_then_defaults_then_eval_flags_then_rollout_flags(tmp_path: Path) -> None:
    path = write(tmp_path, SLIME_MULTI_TASK.format(**data_files(tmp_path)))
    settings = settings_of("--eval-config", str(path), "--eval-interval", "1", "--eval-temperature", "0.3",
                           "--n-samples-per-eval-prompt", "4", "--eval-top-k", "5", "--rm-type", "math")
    aime, gpqa = settings.datasets
    assert aime.sampling_params == {"temperature": 0.3, "top_p": 0.7, "top_k": 5}  # flag, defaults, flag
    assert gpqa.sampling_params == {"temperature": 0.6, "top_p": 0.7, "top_k": 5}  # the dataset wins
    assert (aime.n_samples, gpqa.n_samples, aime.max_response_len) == (16, 2, 16384)
    assert aime.reward.rm_type == "deepscaler" and gpqa.reward.rm_type == "gpqa"  # not the run's math
    assert aime.metadata == {"rm_type": "deepscaler"}, "slime injects the dataset's rm_type into metadata"

    pairs = settings_of("--eval-prompt-data", "d", "builtin:first_digit", "f", path.parent.joinpath("aime.jsonl")
                        .as_posix(), "--eval-interval", "2", "--label-key", "label", "--rm-type", "math")
    digits, file_set = pairs.datasets
    assert digits.sampling_params == {"temperature": 0.9, "top_p": 1.0, "top_k": 20}  # the rollout's
    assert digits.max_response_len == 64 and digits.n_samples == 1
    assert digits.reward.rm_type == "first_digit", "a builtin task keeps its own reward"
    assert file_set.reward.rm_type == "math" and file_set.label_key == "label"


def test_mapping_form_root_without_eval_and_dataset_keys(tmp_path: Path) -> None:
    text = ("defaults: {n_samples_per_eval_prompt: 3}\n"
            "datasets:\n  digits: {path: 'builtin:first_digit', stop: [END], metadata_overrides: {src: x}}\n"
            "  more: {path: 'builtin:copy', stop_token_ids: [2], input_key: q, label_key: a}\n")
    digits, more = read_eval_config(str(write(tmp_path, text)))
    assert (digits.name, digits.n_samples_per_eval_prompt, digits.stop, digits.overrides) == (
        "digits", 3, ("END",), {"src": "x"})
    assert (more.name, more.stop_token_ids, more.input_key, more.label_key) == ("more", (2,), "q", "a")


@pytest.mark.parametrize(("text", "message"), [
    ("datasets:\n  - {name: a, path: p, temprature: 0.5}\n",
     "datasets[0] (a): unknown key 'temprature'; known keys: name, path, rm_type"),
    ("defaults: {topp: 1}\ndatasets:\n  - {name: a, path: p}\n", "defaults: unknown key 'topp'"),
    ("datasets:\n  - {name: a, path: p, tool_key: tools}\n",
     "key 'tool_key' (a slime eval-config key) is not supported by rayless: tool schemas"),
    ("datasets:\n  - {name: a, path: p, rm_type: mathh}\n",
     "datasets[0] (a): key 'rm_type': 'mathh' is not a valid choice; choose from char_match"),
    ("datasets:\n  - {name: a, path: p, top_p: 1.5}\n", "key 'top_p': must be in (0, 1], got 1.5"),
    ("datasets:\n  - {name: a, path: p, n_samples_per_eval_prompt: many}\n",
     "key 'n_samples_per_eval_prompt': expected an integer, got str 'many'"),
    ("datasets:\n  - {path: p}\n", "datasets[0]: key 'name' is required"),
    ("datasets:\n  - {name: a}\n", "datasets[0] (a): key 'path' is required"),
    ("datasets:\n  - {name: a, path: p}\n  - {name: a, path: q}\n", "dataset name(s) 'a' given twice"),
    ("datasets: []\n", "'datasets' must be a non-empty list"),
    ("eval:\n  datasets: [{name: a, path: p}]\n  extra: 1\n", "unknown top-level key(s) 'extra'"),
    ("defaults: {name: x}\ndatasets: [{name: a, path: p}]\n", "key 'name' belongs to each dataset"),
    ("datasets: [oops\n", "not valid YAML"),
    ("- just a list\n", "expected a mapping with 'datasets'"),
])
def test_a_bad_eval_config_is_refused_naming_the_file_dataset_and_key(tmp_path: Path, text: str,
                                                                       message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as error:
        read_eval_config(str(path))
    assert str(error.value).startswith(f"--eval-config {path}") and message in str(error.value)
    # and at start-up, through the flag: the same error, before anything runs
    with pytest.raises(ConfigError, match="--eval-config"):
        parse_config([*BASE, "--eval-config", str(path), "--eval-interval", "1"])


def test_bad_base64_and_missing_file() -> None:
    with pytest.raises(ConfigError, match=r"--eval-config base64:…: the text after 'base64:' is not base64"):
        read_eval_config("base64:%%%")
    with pytest.raises(ConfigError, match=r"--eval-config /no/such.yaml: no such file"):
        read_eval_config("/no/such.yaml")


def test_eval_config_replaces_eval_prompt_data_with_a_warning(tmp_path: Path) -> None:
    path = write(tmp_path, "datasets: [{name: cfg, path: 'builtin:copy'}]\n")
    with pytest.warns(ConfigWarning, match="--eval-config replaces --eval-prompt-data"):
        config = parse_config([*BASE, "--eval-config", str(path), "--eval-prompt-data", "d", "builtin:first_digit",
                               "--eval-interval", "1"])
    assert config.eval.eval_datasets == [("cfg", "builtin:copy")]
    assert config.rollout_engine_eval_enabled and not config.eval_fleet_enabled


def test_an_edited_file_is_read_again(tmp_path: Path) -> None:
    path = write(tmp_path, "datasets: [{name: one, path: 'builtin:copy'}]\n")
    assert parse_config([*BASE, "--eval-config", str(path), "--eval-interval", "1"]).eval.eval_datasets[0][0] == "one"
    path.write_text("datasets: [{name: second, path: 'builtin:copy'}]\n")
    assert parse_config([*BASE, "--eval-config", str(path), "--eval-interval", "1"]).eval.eval_datasets[0][0] == (
        "second")


def test_where_eval_runs() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        on_engines = parse_config([*BASE, "--eval-interval", "2", "--eval-prompt-data", "d", "builtin:copy"])
        fleet = parse_config([*BASE, "--eval-interval", "2", "--eval-prompt-data", "d", "builtin:copy",
                              "--eval-num-engines", "1"])
        no_interval = parse_config([*BASE, "--eval-prompt-data", "d", "builtin:copy"])
        train_only = parse_config([*BASE, "--debug-train-only", "--eval-interval", "2", "--eval-prompt-data", "d",
                                   "builtin:copy"])
    assert on_engines.rollout_engine_eval_enabled and not on_engines.eval_fleet_enabled
    assert fleet.eval_fleet_enabled and not fleet.rollout_engine_eval_enabled
    assert not no_interval.rollout_engine_eval_enabled and not train_only.rollout_engine_eval_enabled
    assert not on_engines.eval.skip_eval_before_train
    assert parse_config([*BASE, "--eval-interval", "2", "--eval-prompt-data", "d", "builtin:copy",
                         "--skip-eval-before-train"]).eval.skip_eval_before_train


def test_replay_warns_that_eval_on_the_rollout_engines_is_skipped() -> None:
    with pytest.warns(ConfigWarning, match="--load-debug-rollout-data starts no engines: --eval-interval is "
                                           "ignored"):
        config = parse_config(["--hf-checkpoint", "/m", "--load-debug-rollout-data", "d/{rollout_id}.rld",
                               "--eval-interval", "1", "--eval-prompt-data", "d", "builtin:copy"])
    assert not config.rollout_engine_eval_enabled


def test_start_up_checks_each_datasets_reward_and_files(tmp_path: Path) -> None:
    files = data_files(tmp_path)
    dapo = write(tmp_path, f"datasets: [{{name: aime, path: {files['aime']}, rm_type: dapo}}]\n", "dapo.yaml")
    config = parse_config([*BASE, "--eval-config", str(dapo), "--eval-interval", "1"])
    with pytest.raises(ConfigError, match=r"eval dataset 'aime': rm_type dapo returns a dict reward .*"
                                          r"--eval-reward-key"):
        check_rewards(config)
    check_rewards(parse_config([*BASE, "--eval-config", str(dapo), "--eval-interval", "1", "--eval-reward-key",
                                "score"]))
    remote = write(tmp_path, f"datasets: [{{name: r, path: {files['aime']}, rm_type: remote_rm}}]\n", "r.yaml")
    with pytest.raises(ConfigError, match=r"eval dataset 'r': rm_type remote_rm needs --rm-url"):
        check_rewards(parse_config([*BASE, "--eval-config", str(remote), "--eval-interval", "1"]))
    no_reward = parse_config([*BASE, "--prompt-data", files["aime"], "--eval-prompt-data", "f", files["aime"],
                              "--eval-interval", "1"])
    with pytest.raises(ConfigError, match=r"eval dataset 'f' .*no reward to score it"):
        check_rewards(no_reward)
    missing = write(tmp_path, "datasets: [{name: gone, path: /no/such.jsonl, rm_type: math}]\n", "m.yaml")
    config = parse_config([*BASE, "--eval-config", str(missing), "--eval-interval", "1"])
    with pytest.raises(ConfigError, match=r"--eval-config gone /no/such.jsonl: no such file"):
        check_paths(dataclasses_replace_checkpoint(config, tmp_path))


def dataclasses_replace_checkpoint(config: object, tmp_path: Path) -> object:
    """The config with an --hf-checkpoint that exists (check_paths looks at it first)."""
    import dataclasses

    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    return dataclasses.replace(config, rollout=dataclasses.replace(config.rollout,  # type: ignore[arg-type]
                                                                   hf_checkpoint=str(model)))


def test_datasets_load_with_their_keys_template_and_metadata(tmp_path: Path) -> None:
    qa = tmp_path / "qa.jsonl"
    qa.write_text(json.dumps({"q": "What?", "a": "B", "meta": {"choices": ["x", "y"]}}) + "\n")
    path = write(tmp_path, f"datasets: [{{name: qa, path: {qa}, input_key: q, label_key: a, metadata_key: meta, "
                           "rm_type: gpqa, metadata_overrides: {source: test}}]\n")
    settings = settings_of("--eval-config", str(path), "--eval-interval", "1")
    (dataset,) = load_eval_datasets(settings)
    (record,) = dataset.records
    assert (record.prompt, record.label) == ("What?", "B")
    assert record.metadata == {"choices": ["x", "y"], "source": "test", "rm_type": "gpqa"}
    assert dataset.reward_model.rm_type == "gpqa" and dataset.settings.n_samples == 1
    digits = load_eval_datasets(settings_of("--eval-prompt-data", "d", "builtin:first_digit", "--eval-interval",
                                            "1"))[0]
    assert len(digits.records) == 32 and digits.reward_model.rm_type == "first_digit"


def test_start_up_refuses_math_verify_without_its_package(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from coordinator.rewards.math_verify_rule import math_verify_library

    config = parse_config([*BASE, "--rm-type", "math_verify"])
    with monkeypatch.context() as patch:
        patch.setitem(sys.modules, "math_verify", None)  # an import of it fails
        math_verify_library.cache_clear()
        with pytest.raises(ConfigError, match=r"--rm-type math_verify: .*pip install 'rayless\[math-verify\]'"):
            check_rewards(config)
    math_verify_library.cache_clear()
    pytest.importorskip("math_verify", reason="Math-Verify is the math-verify extra (in dev)")
    check_rewards(config)


async def test_eval_max_context_len_caps_eval_prompts_plus_responses_and_falls_back_to_the_rollouts(
    tmp_path: Path
) -> None:
    """miles' --eval-max-context-len (default --rollout-max-context-len): an eval sample's max new tokens are
    clipped so prompt + response fit it, on the eval fleet as on the rollout engines."""
    from coordinator.engines.client import EngineClient
    from coordinator.engines.fleet import EngineFleet
    from coordinator.eval.fleet import EvalFleet
    from coordinator.eval.settings import load_eval_datasets

    flags = ["--eval-interval", "1", "--eval-prompt-data", "d", "builtin:first_digit", "--eval-max-response-len", "8"]
    assert settings_of(*flags).max_context_len is None
    assert settings_of(*flags, "--rollout-max-context-len", "40").max_context_len == 40
    settings = settings_of(*flags, "--rollout-max-context-len", "40", "--eval-max-context-len", "12")
    assert settings.max_context_len == 12
    async with EngineClient(max_connections=1) as client:
        fleet = EngineFleet(client=client, group="eval", external_urls=["127.0.0.1:1"], run_dir=tmp_path)
        evals = EvalFleet(settings=settings, fleet=fleet, client=client, tokenizer=None, exporter=None,
                          snapshot_dir=tmp_path, probe_before_pin=True, datasets=load_eval_datasets(settings))
        state = evals.generate_states["d"]
        assert [state.max_new_tokens(prompt) for prompt in (2, 6, 12)] == [8, 6, 0]


def test_eval_tool_key_falls_back_to_the_tool_key() -> None:
    flags = ["--eval-interval", "1", "--eval-prompt-data", "d", "builtin:first_digit"]
    assert settings_of(*flags).datasets[0].tool_key is None
    assert settings_of(*flags, "--tool-key", "tools").datasets[0].tool_key == "tools"
    assert settings_of(*flags, "--tool-key", "tools", "--eval-tool-key", "eval_tools").datasets[0].tool_key == \
        "eval_tools"
