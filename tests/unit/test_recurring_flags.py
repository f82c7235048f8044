"""The recurring slime/miles flags of issue 21 item 6: `--train-env-vars` in the ranks' environment,
`--router-*` on sglang-router's command line (read back by sglang-router's own parser),
`--custom-reward-post-process-path` (slime's `fn(args, samples) -> (raw_rewards, rewards)`), `--log-reward-category`
and `--disable-rollout-global-dataset`."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from coordinator.checks.preflight import check_hooks
from coordinator.config import ConfigError, parse_config
from coordinator.plan import GpuInventory, build_plan
from coordinator.rollout.reward_post import RewardPostProcess, RewardPostProcessError, reward_category_metrics
from coordinator.train.torchrun import TorchrunProcess
from replay.sample import Sample, SampleStatus

BASE = ["--hf-checkpoint", "/m", "--rollout-batch-size", "2", "--num-rollout", "1", "--prompt-data",
        "builtin:first_digit", "--run-dir", "/runs/x", "--n-samples-per-prompt", "2"]


def _plan(*flags: str, gpus: int = 0):
    return build_plan(parse_config([*BASE, *flags]), GpuInventory.of_count(gpus, "injected", injected=True),
                      has_sglang=False)


def test_train_env_vars_reach_the_ranks_and_cannot_replace_rayless_variables(tmp_path: Path) -> None:
    node = _plan("--rollout-num-engines", "1", "--train-env-vars",
                 json.dumps({"NCCL_DEBUG": "INFO", "CUDA_VISIBLE_DEVICES": "9", "MY_FLAG": 1})).nodes[0]
    assert node.ranks is not None
    torchrun = TorchrunProcess(node.ranks.spec, log_path=tmp_path / "log", extra_env=dict(node.ranks.env))
    env = torchrun.child_environment({"RAYLESS_CONTROL_ADDR": "127.0.0.1:1", "RAYLESS_CONTROL_TOKEN": "t"})
    assert env["NCCL_DEBUG"] == "INFO" and env["MY_FLAG"] == "1"
    on_gpu = _plan("--rollout-num-gpus", "1", "--train-env-vars", '{"CUDA_VISIBLE_DEVICES": "9"}', gpus=2)
    ranks = on_gpu.nodes[0].ranks
    assert ranks is not None and dict(ranks.env)["CUDA_VISIBLE_DEVICES"] != "9"  # the plan's GPUs win


def test_router_flags_reach_sglang_routers_own_parser() -> None:
    from sglang_router.launch_router import parse_router_args

    node = _plan("--rollout-num-engines", "2", "--use-sglang-router", "--router-policy", "round_robin",
                 "--router-health-check-interval-secs", "7", "--router-max-payload-size", "1024").nodes[0]
    assert node.router is not None
    command = node.router.command()
    parsed = parse_router_args(command[command.index("sglang_router.launch_router") + 1:])
    assert parsed.policy == "round_robin"  # --router-policy wins over rayless' --policy default
    assert parsed.health_check_interval_secs == 7 and parsed.max_payload_size == 1024


def _group(rewards: list[float]) -> list[Sample]:
    return [Sample(group_index=0, sample_index=i, reward=r, loss_mask=[1, 1], status=SampleStatus.COMPLETED)
            for i, r in enumerate(rewards)]


def test_reward_post_process_output_becomes_the_advantages() -> None:
    seen = {}

    def post_process(args, samples):
        seen["args"], seen["count"] = args, len(samples)
        raw = [s.get_reward_value(args) if hasattr(s, "get_reward_value") else s.reward for s in samples]
        return raw, [10.0 * value for value in raw]

    groups = [_group([1.0, 0.0]), _group([0.5, 0.5])]
    RewardPostProcess(post_process, "m:post_process", args="ARGS").apply(groups, normalize_advantages=False)
    assert seen == {"args": "ARGS", "count": 4}
    assert [s.advantage for g in groups for s in g] == [10.0, 0.0, 5.0, 5.0]
    assert [s.metadata["raw_reward"] for g in groups for s in g] == [1.0, 0.0, 0.5, 0.5]


@pytest.mark.parametrize("result", [None, ([1.0], [1.0]), ([1.0, 2.0], [1.0, float("nan")]), ([1, 2], "ab")])
def test_reward_post_process_bad_output_is_refused_before_any_change(result) -> None:
    group = _group([1.0, 0.0])
    with pytest.raises(RewardPostProcessError, match="--custom-reward-post-process-path m:f"):
        RewardPostProcess(lambda args, samples: result, "m:f", args=None).apply([group], normalize_advantages=False)
    assert [s.advantage for s in group] == [0.0, 0.0]


def test_reward_post_process_signature_is_checked_at_start_up(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "post_hooks.py").write_text(textwrap.dedent("""
        def slime_form(args, samples):
            return [], []
        def wrong(sample):
            return 0
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("post_hooks", None)
    flags = [*BASE, "--rollout-num-engines", "1", "--custom-reward-post-process-path"]
    notes = check_hooks(parse_config([*flags, "post_hooks.slime_form"]))
    assert any("--custom-reward-post-process-path" in note and "(slime's form)" in note for note in notes)
    with pytest.raises(ConfigError, match="--custom-reward-post-process-path"):
        check_hooks(parse_config([*flags, "post_hooks.wrong"]))


def test_log_reward_category_is_slimes_error_cat_share() -> None:
    samples = _group([0.0, 0.0, 0.0, 0.0])
    for sample, category in zip(samples, ["format", "format", "wrong", None], strict=True):
        sample.reward = {"score": 0.0, "why": category}
    assert reward_category_metrics(samples, "why") == {"error_cat/format": 0.5, "error_cat/wrong": 0.25,
                                                       "error_cat/None": 0.25}
    assert parse_config([*BASE, "--rollout-num-engines", "1", "--log-reward-category", "why"]).rollout \
        .log_reward_category == "why"


def test_disable_rollout_global_dataset_needs_a_rollout_function_that_brings_its_data() -> None:
    with pytest.raises(ConfigError, match="--disable-rollout-global-dataset"):
        parse_config([*BASE, "--rollout-num-engines", "1", "--disable-rollout-global-dataset"])
    config = parse_config([*BASE, "--rollout-num-engines", "1", "--disable-rollout-global-dataset",
                           "--rollout-function-path", "my_pkg.rollout.generate_rollout"])
    assert config.rollout.disable_rollout_global_dataset


def test_miles_delegate_in_eval_config_is_accepted_and_named_in_the_notice(tmp_path: Path) -> None:
    from coordinator.config.porting import porting_notice

    data = tmp_path / "aime.jsonl"
    data.write_text('{"prompt": "1+1", "label": "2"}\n')
    config_file = tmp_path / "eval.yaml"
    config_file.write_text(textwrap.dedent(f"""
        eval:
          datasets:
            - name: aime
              path: {data}
          delegate:
            - name: skills
              url: http://127.0.0.1:9050/evaluate
              datasets:
                - name: aime25
    """))
    config = parse_config([*BASE, "--rollout-num-engines", "1", "--eval-config", str(config_file),
                           "--eval-interval", "1"])
    assert [spec.name for spec in config.eval.dataset_specs] == ["aime"]
    assert "--eval-config delegate skills: run by an --eval-function-path" in (porting_notice(config) or "")
    config_file.write_text("eval:\n  datasets: []\n  delegate: {skills: 1}\n")
    with pytest.raises(ConfigError, match="'delegate' must be a list"):
        parse_config([*BASE, "--rollout-num-engines", "1", "--eval-config", str(config_file)])


def test_a_single_eval_prompt_data_path_is_slimes_legacy_aime() -> None:
    from coordinator.config.porting import porting_notice

    config = parse_config([*BASE, "--rollout-num-engines", "1", "--eval-prompt-data", "/data/aime.jsonl",
                           "--eval-interval", "1"])
    assert config.eval.eval_prompt_data == ("aime", "/data/aime.jsonl")
    assert "--eval-prompt-data /data/aime.jsonl → aime /data/aime.jsonl" in (porting_notice(config) or "")


def test_routing_replay_is_a_no_op_for_a_dense_model_and_refused_for_moe(tmp_path: Path) -> None:
    from coordinator.config.porting import porting_notice

    dense, moe = tmp_path / "dense", tmp_path / "moe"
    for directory, config in ((dense, {"num_hidden_layers": 2}), (moe, {"num_hidden_layers": 2, "num_experts": 8})):
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps(config))
    flags = ["--rollout-batch-size", "1", "--num-rollout", "1", "--prompt-data", "builtin:first_digit",
             "--rollout-num-engines", "1", "--use-rollout-routing-replay"]
    config = parse_config(["--hf-checkpoint", str(dense), *flags])
    assert "--use-rollout-routing-replay: the model has no MoE layers" in (porting_notice(config) or "")
    with pytest.raises(ConfigError, match=r"MoE routing replay \(R3\).*8 experts"):
        parse_config(["--hf-checkpoint", str(moe), *flags])
    with pytest.raises(ConfigError, match="cannot be read"):
        parse_config(["--hf-checkpoint", str(tmp_path / "missing"), *flags])


def test_apply_chat_template_kwargs_reach_every_rendering(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    from coordinator.data.source import PromptDataSource, PromptRecord
    from coordinator.hooks.args import build_hook_args
    from coordinator.rollout.chat_kwargs import with_chat_template_kwargs

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)
    tokenizer.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                               "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}")
    config = parse_config([*BASE, "--rollout-num-engines", "1", "--apply-chat-template",
                           "--apply-chat-template-kwargs", '{"enable_thinking": false}'])
    wrapped = with_chat_template_kwargs(tokenizer, config.rollout.chat_template_kwargs)
    source = PromptDataSource.from_records([PromptRecord(prompt="hi", label=None, metadata={})],
                                           apply_chat_template=True, tokenizer=wrapped, shuffle=False, seed=0)
    assert source.take(1)[0].prompt == "hi<no-think>"
    assert wrapped("hi")["input_ids"] == tokenizer("hi")["input_ids"] and len(wrapped) == len(tokenizer)
    assert build_hook_args(config).apply_chat_template_kwargs == {"enable_thinking": False}
    assert with_chat_template_kwargs(tokenizer, {}) is tokenizer
    with pytest.raises(ConfigError, match="--apply-chat-template-kwargs"):
        parse_config([*BASE, "--rollout-num-engines", "1", "--apply-chat-template-kwargs", "[1]"])
