"""The slime-shaped hook API, in this process: `Sample`'s slime methods, the start-up reading of hook signatures
(ours and slime's), the hooks' `args`, `--custom-config-path`, `GenerateState(args)`, slime-form rewards and
filters, miles' tool-call parsing, and the multi-turn metrics."""

from __future__ import annotations

import argparse
import enum
import math
import re
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import anyio
import pytest

from coordinator.checks.preflight import check_hook_signature, preflight
from coordinator.config import parse_config
from coordinator.config.fields import ConfigError, ConfigWarning
from coordinator.hooks import DynamicFilterOutput, GenerateState, HookError, Sample, Status
from coordinator.hooks.args import build_hook_args, hook_sampling_params
from coordinator.hooks.runtime import HookRuntime
from coordinator.hooks.tool_calls import parse_tool_calls, tokenize_tool_responses
from coordinator.rollout.filters import DynamicFilter
from coordinator.rollout.generate import model_turns, multi_turn_metrics
from coordinator.rollout.requests import RequestSlots
from coordinator.rollout.rewards import RewardModel
from replay.sample import SampleError, SampleStatus, settle_hook_fields
from tests.support.miles_rollout_fns import SyncFixedRolloutFn, VerifiersShapedRolloutFn
from tests.support.rollout_fns import CountingRollout


# --- Sample, as slime's ---------------------------------------------------------------------------------------
def test_append_response_tokens_keeps_masks_and_logprobs_aligned_as_slime() -> None:
    sample = Sample(prompt="3+4", tokens=[1, 2, 3])
    assert Sample.Status is Status is SampleStatus and sample.status is Sample.Status.PENDING
    sample.append_response_tokens(None, tokens=[7], log_probs=[-0.5], meta_info={
        "finish_reason": {"type": "stop"}, "weight_version": "4"}, text="=")
    sample.append_response_tokens(None, tokens=[8, 9], trainable=False, text="7;")
    sample.append_response_tokens(None, tokens=[10], log_probs=[-1.5], meta_info={
        "finish_reason": {"type": "length"}, "weight_version": "4"})
    assert sample.tokens == [1, 2, 3, 7, 8, 9, 10] and sample.response_length == 4 and sample.response == "=7;"
    assert sample.loss_mask == [1, 0, 0, 1] and sample.rollout_log_probs == [-0.5, 0.0, 0.0, -1.5]
    assert sample.status is Status.TRUNCATED and sample.weight_versions == ["4"]
    assert sample.is_multi_turn and sample.effective_response_length == 2 and model_turns(sample) == 2
    with pytest.raises(SampleError, match="need their rollout logprobs"):
        sample.append_response_tokens(None, tokens=[11])
    with pytest.raises(SampleError, match="take no rollout logprobs"):
        sample.append_response_tokens(None, tokens=[11], log_probs=[-1.0], trainable=False)
    with pytest.raises(SampleError, match="1 entries for 2 tokens"):
        sample.append_response_tokens(None, tokens=[11, 12], log_probs=[-1.0])


def test_to_dict_from_dict_and_attributes_hooks_add() -> None:
    sample = Sample(prompt="q", label={"ground_truth": {"target": ["a"]}}, reward={"score": 1.0})
    sample.tool_call_count = 2  # retool's ad-hoc attribute
    data = sample.to_dict()
    assert data["status"] == "pending" and data["tool_call_count"] == 2
    back = Sample.from_dict(data)
    assert back.tool_call_count == 2 and back.extra_attributes() == {"tool_call_count": 2} and back.label == sample.label
    assert back.get_reward_value(argparse.Namespace(reward_key="score")) == 1.0


class TheirStatus(enum.Enum):  # slime's own Sample.Status, as a hook that builds samples itself might use
    COMPLETED = "completed"


def test_a_hooks_sample_is_settled_into_our_invariant() -> None:
    sample = Sample(tokens=[1, 2, 3], response_length=2, status=TheirStatus.COMPLETED)  # type: ignore[arg-type]
    sample.loss_mask, sample.rollout_log_probs = None, [-1.0, -2.0]  # type: ignore[assignment]
    settle_hook_fields(sample, where="hook")
    assert sample.loss_mask == [1, 1] and sample.status is Status.COMPLETED
    no_logprobs = Sample(tokens=[1, 2, 3], response_length=1, rollout_log_probs=None)  # type: ignore[arg-type]
    with pytest.raises(SampleError, match="hook: the sample has 1 response tokens but no rollout_log_probs"):
        settle_hook_fields(no_logprobs, where="hook")
    nan = Sample(tokens=[1, 2, 3], response_length=2, loss_mask=[1, 0], rollout_log_probs=[math.nan, math.nan])
    with pytest.raises(SampleError, match=r"at response token 0 \(a trained token\) is not finite"):
        settle_hook_fields(nan, where="hook")
    nan.loss_mask = [0, 0]
    settle_hook_fields(nan, where="hook")  # a tool token's value is never read
    short = Sample(tokens=[1], response_length=2, loss_mask=[1, 1], rollout_log_probs=[0.0, 0.0])
    with pytest.raises(SampleError, match=r"hook: sample 0/0: response_length 2 outside 0\.\.1"):
        settle_hook_fields(short, where="hook")


# --- hook signatures at start-up --------------------------------------------------------------------------------
async def slime_reward(args, sample, **kwargs):
    return 1.0


async def slime_group_reward(args, samples, **kwargs):
    return [1.0] * len(samples)


def our_reward(sample):
    return 1.0


def slime_filter(args, samples, **kwargs):
    return DynamicFilterOutput(keep=False, reason="boring")


async def slime_generate(args, sample, sampling_params, evaluation=False):
    return sample


async def slime_generate_train_only(args, sample, sampling_params):
    return sample


async def miles_generate(input):
    return input


def sync_generate(args, sample, sampling_params):
    return sample


def slime_rollout(args, rollout_id, data_source, evaluation=False):
    return []


def our_rollout(context, rollout_id, weight_version):
    return []


def slime_tis(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs):
    return pg_loss, loss_masks, {}


async def execute_tool(name, params):
    return ""


class NoCallRollout:
    def __init__(self, input):
        pass


class TwoArgRollout:
    def __init__(self, input, other):
        pass

    def __call__(self, input):
        return None


@pytest.mark.parametrize(("flag", "target", "group_rm", "shown"), [
    ("--custom-rm-path", slime_reward, False, "slime_reward(args, sample, **kwargs) (slime's form)"),
    ("--custom-rm-path", slime_group_reward, True, "slime_group_reward(args, samples, **kwargs) (slime's form)"),
    ("--custom-rm-path", our_reward, False, "our_reward(sample)"),
    ("--dynamic-sampling-filter-path", slime_filter, False, "slime_filter(args, samples, **kwargs)"),
    ("--custom-generate-function-path", slime_generate, False,
     "await slime_generate(args, sample, sampling_params, evaluation=...)"),
    ("--custom-generate-function-path", slime_generate_train_only, False,
     "await slime_generate_train_only(args, sample, sampling_params)"),
    ("--custom-generate-function-path", miles_generate, False, "(miles' GenerateFnInput form)"),
    ("--rollout-function-path", slime_rollout, False, "slime_rollout(args, rollout_id, data_source"),
    ("--rollout-function-path", our_rollout, False, "our_rollout(context, rollout_id, weight_version)"),
    ("--eval-function-path", slime_rollout, False, "(slime's form)"),
    ("--rollout-function-path", VerifiersShapedRolloutFn, False,
     "VerifiersShapedRolloutFn(RolloutFnConstructorInput(args, data_source)), called as instance("
     "RolloutFnTrainInput | RolloutFnEvalInput) (async __call__; miles' form)"),
    ("--eval-function-path", SyncFixedRolloutFn, False, "(sync __call__; miles' form)"),
    ("--rollout-function-path", CountingRollout, False,
     "class, built as CountingRollout(context), called as instance(rollout_id, weight_version)"),
    ("--custom-tis-function-path", slime_tis, False, "(pg_loss, loss_masks, metrics) (slime's form)"),
    ("--generate-execute-tool-function-path", execute_tool, False, "await execute_tool(name, params) -> str"),
])
def test_slimes_hook_forms_and_ours_are_accepted(flag: str, target: Any, group_rm: bool, shown: str) -> None:
    assert shown in check_hook_signature(flag, "m:f", target, group_rm=group_rm)


@pytest.mark.parametrize(("flag", "target", "group_rm", "message"), [
    ("--custom-rm-path", lambda a, b, c: 0, False, "rayless calls it as <lambda>(sample) or as <lambda>(args, "
                                                   "sample, **kwargs) (slime's form), but its signature is (a, b, c)"),
    ("--custom-generate-function-path", sync_generate, False, "must be an async function"),
    ("--custom-generate-function-path", slime_reward, False, "await slime_reward(args, sample, sampling_params"),
    ("--rollout-function-path", lambda x: x, False, "rayless calls it as <lambda>(context, rollout_id"),
    ("--rollout-function-path", NoCallRollout, False, "instances of class NoCallRollout are not callable"),
    ("--eval-function-path", TwoArgRollout, False, "rayless builds a class as TwoArgRollout(context), called as "
                                                   "instance(rollout_id, weight_version), or in miles' form"),
    ("--custom-tis-function-path", lambda args, pg_loss: 0, False, "loss_masks, total_lengths"),
    ("--generate-tool-specs-path", {"name": "x"}, False, "expected a non-empty list of tool specs"),
])
def test_a_hook_that_fits_no_form_is_refused_naming_the_flag(flag: str, target: Any, group_rm: bool,
                                                             message: str) -> None:
    with pytest.raises(ConfigError, match=f"^{re.escape(flag)} 'm:f': .*{re.escape(message)}"):
        check_hook_signature(flag, "m:f", target, group_rm=group_rm)


# --- args, GenerateState, --custom-config-path -----------------------------------------------------------------
BASE = ["--prompt-data", "builtin:first_digit", "--rollout-batch-size", "2", "--num-rollout", "1",
        "--rollout-num-engines", "2"]


def test_hook_args_carry_slimes_names_and_no_secret(tiny_model_dir: Path) -> None:
    config = parse_config(["--hf-checkpoint", str(tiny_model_dir), *BASE, "--sglang-api-key", "s3cret",
                           "--rollout-max-context-len", "64", "--partial-rollout", "--n-samples-per-prompt", "4"])
    args = build_hook_args(config)
    assert (args.rollout_max_context_len, args.n_samples_per_prompt, args.partial_rollout) == (64, 4, True)
    assert args.max_tokens_per_gpu == 8192 and args.context_parallel_size == 1 and args.rollout_num_gpus == 2
    assert args.rollout_stop == [] and args.hf_checkpoint == str(tiny_model_dir)
    assert args.sglang_router_ip is None and args.sglang_router_port is None  # bound by the run
    assert args.sglang_api_key is None and "s3cret" not in repr(vars(args))
    params = hook_sampling_params(config)
    assert params["no_stop_trim"] is True and params["max_new_tokens"] == config.rollout.rollout_max_response_len

    runtime = HookRuntime(args=args, api_key="s3cret")
    with pytest.raises(HookError, match="GenerateState is not built in this run"):
        GenerateState(args)
    runtime.attach_generate_state(tokenizer="tok", sampling_params=params, slots=RequestSlots(3))
    state = GenerateState(args)
    assert state is GenerateState(args) and state.tokenizer == "tok" and state.args is args
    with pytest.raises(HookError, match="needs the args rayless passes"):
        GenerateState(argparse.Namespace())
    runtime.bind_address("127.0.0.1", 4321)
    assert (args.sglang_router_ip, args.sglang_router_port) == ("127.0.0.1", 4321)
    assert runtime.is_own_address("http://127.0.0.1:4321/generate") and not runtime.is_own_address(
        "http://127.0.0.1:4322/generate")

    async def hold() -> int:
        async with state.semaphore:
            return state.semaphore.free

    assert anyio.run(hold) == 2 and state.semaphore.free == 3


def test_custom_config_path_sets_flags_and_args_attributes(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "mis.yaml"
    path.write_text("use_tis: true\ntis_clip: 3.0\ntis_level: token\nrs_lower_bound: 0.5\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = parse_config(["--hf-checkpoint", str(tiny_model_dir), *BASE, "--tis-clip", "2.5",
                               "--custom-config-path", str(path)])
    assert config.train.use_tis and config.train.tis_clip == 3.0  # as slime: the file wins
    assert any(issubclass(w.category, ConfigWarning) and "tis_clip = 3.0 overrides --tis-clip" in str(w.message)
               for w in caught)
    args = build_hook_args(config)
    assert (args.tis_level, args.rs_lower_bound, args.use_tis) == ("token", 0.5, True)
    path.write_text("tis_clip: -1\n")
    with pytest.raises(ConfigError, match=r"--custom-config-path .*mis.yaml: key 'tis_clip': must be ≥ 0"):
        parse_config(["--hf-checkpoint", str(tiny_model_dir), *BASE, "--custom-config-path", str(path)])
    with pytest.raises(ConfigError, match=r"--custom-config-path .*absent\.yaml: no such file"):
        parse_config(["--hf-checkpoint", str(tiny_model_dir), *BASE, "--custom-config-path",
                      str(tmp_path / "absent.yaml")])


def test_preflight_checks_the_hooks_before_anything_starts(tiny_model_dir: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_hooks.py").write_text(textwrap.dedent("""
        async def generate(args, sample, sampling_params):
            return sample
        def generate_sync(args, sample, sampling_params):
            return sample
        async def reward_func(args, sample, **kwargs):
            return 0.0
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_hooks", raising=False)
    flags = ["--hf-checkpoint", str(tiny_model_dir), *BASE, "--custom-rm-path", "my_hooks.reward_func"]
    notes = preflight(parse_config([*flags, "--custom-generate-function-path", "my_hooks.generate"]))
    assert any("--custom-generate-function-path my_hooks.generate: called as await generate(args, sample, "
               "sampling_params)" in note for note in notes)
    with pytest.raises(ConfigError, match=re.escape("--custom-generate-function-path 'my_hooks.generate_sync': "
                                                    "must be an async function")):
        preflight(parse_config([*flags, "--custom-generate-function-path", "my_hooks.generate_sync"]))
    with pytest.raises(ConfigError, match=re.escape("--custom-generate-function-path 'my_hooks.nope': 'my_hooks' "
                                                    "has no attribute 'nope'")):
        preflight(parse_config([*flags, "--custom-generate-function-path", "my_hooks.nope"]))


# --- slime-form rewards and filters -----------------------------------------------------------------------------
async def test_a_slime_reward_gets_args_and_may_return_slimes_extras() -> None:
    seen: list[Any] = []

    async def reward_func(args, sample, **kwargs):  # retool's shape: score, acc (bool), pred (text)
        seen.append(args)
        return {"score": -1.0, "acc": False, "pred": "35"}

    args = argparse.Namespace(reward_key="score")
    model = RewardModel(custom_rm=reward_func, reward_key="score", args=args)
    samples = [Sample(response="x", status=Status.COMPLETED), Sample(response="y", status=Status.FAILED),
               Sample(response="z", status=Status.COMPLETED, reward=0.25)]
    await model.score_group(samples, keep_given=True)
    assert seen == [args]  # one sample scored: the failed one gets 0.0, the third keeps its reward
    assert samples[0].reward == {"score": -1.0, "acc": 0.0} and samples[0].metadata["reward_info"] == {"pred": "35"}
    assert [s.reward for s in samples[1:]] == [0.0, 0.25]


async def test_a_slime_group_reward_and_filter() -> None:
    model = RewardModel(custom_rm=slime_group_reward, group_rm=True, args=argparse.Namespace())
    samples = [Sample(status=Status.COMPLETED) for _ in range(3)]
    await model.score_group(samples)
    assert [s.reward for s in samples] == [1.0, 1.0, 1.0]
    dynamic = DynamicFilter(slime_filter, name="m:slime_filter", args=argparse.Namespace())
    result = await dynamic(samples)
    assert (result.keep, result.reason) == (False, "boring") and dynamic.metrics()[
        "rollout/filter_drop/boring"] == 1.0


# --- miles' tool calls ------------------------------------------------------------------------------------------
SPECS = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]


def test_qwen25_tool_calls_are_parsed_and_unknown_tools_skipped() -> None:
    text = ('I will compute. <tool_call>\n{"name": "calculator", "arguments": {"expression": "3+4"}}\n</tool_call>'
            '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call><tool_call>{not json}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>')
    calls = parse_tool_calls(text, SPECS, "qwen25")
    assert [(c.name, c.arguments) for c in calls] == [("calculator", {"expression": "3+4"}),
                                                       ("calculator", {"expression": "1+1"})]


def test_tool_responses_are_the_chat_templates_own_tokens(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    ids = tokenize_tool_responses([{"role": "tool", "name": "calculator", "content": "7"}], tokenizer)
    assert tokenizer.decode(ids) == "<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n"


def test_multi_turn_metrics_are_slimes() -> None:
    one = Sample(tokens=[1, 2, 3, 4], response_length=3, loss_mask=[1, 0, 1], rollout_log_probs=[0.0] * 3)
    two = Sample(tokens=[1, 2], response_length=1, loss_mask=[1], rollout_log_probs=[0.0])
    metrics = multi_turn_metrics([one, two], max_response_len=3)
    assert metrics["multi_turn/raw_response_length/response_length_mean"] == 2.0
    assert metrics["multi_turn/wo_obs_response_length/response_length_max"] == 2.0
    assert metrics["multi_turn/multi_turn_metric/round_number_max"] == 2.0
    assert metrics["multi_turn/raw_response_length/response_length_clip_ratio"] == 0.5


def test_a_tis_hook_and_its_args_travel_to_the_ranks(tiny_model_dir: Path, tmp_path: Path) -> None:
    from coordinator.hooks.args import tis_hook_args
    from coordinator.train.settings import train_settings

    path = tmp_path / "mis.yaml"
    path.write_text("use_tis: true\ntis_level: token\n")
    config = parse_config(["--hf-checkpoint", str(tiny_model_dir), *BASE, "--custom-config-path", str(path),
                           "--custom-tis-function-path", "tests.support.tis_hooks:vanilla", "--sglang-api-key", "k"])
    settings = train_settings(config, tis_hook_args=tis_hook_args(config)).loss
    assert settings.use_tis and settings.tis_function_path == "tests.support.tis_hooks:vanilla"
    assert settings.hook_args is not None and settings.hook_args["tis_level"] == "token"
    assert settings.hook_args["tis_clip"] == 2.0 and settings.hook_args["sglang_api_key"] is None
    assert check_hook_signature("--custom-tis-function-path", "tests.support.tis_hooks:vanilla",
                                __import__("tests.support.tis_hooks", fromlist=["vanilla"]).vanilla)
