"""On-policy distillation's parts without processes: the flags and upstream's start-up rules, the teacher routes,
the teacher's answer read back, the reverse-KL term on the advantages, teacher logprobs in dumps, and the plan's
teacher engine."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
import torch

from coordinator.config import ConfigError, parse_config
from coordinator.config.distill import teacher_hook
from coordinator.engines.replies import GenerateAnswer
from coordinator.engines.reply_decode import read_generate_answer
from coordinator.plan import GpuInventory, build_plan
from coordinator.rollout.teacher import (
    TeacherError,
    TeacherScorer,
    require_teacher_log_probs,
    response_log_probs,
    score_payload,
    settle_teacher_log_probs,
)
from coordinator.train.settings import train_settings
from replay.format import write_dump
from replay.reader import read_dump
from replay.sample import Sample, SampleError, SampleStatus
from workers.boundary.json_input import DEFAULT_LIMITS
from workers.protocol import WireSample
from workers.protocol.train_settings import OpdSettings
from workers.train_rank.distill import Distiller, DistillError, teacher_tensor

BASE = ["--rollout-num-engines", "1", "--hf-checkpoint", "/m", "--num-rollout", "1", "--rollout-batch-size", "1",
        "--prompt-data", "builtin:first_digit", "--run-dir", "/runs/x"]
SGLANG = ["--use-opd", "--opd-type", "sglang"]


def model_dir(tmp_path: Path, name: str = "teacher") -> Path:
    directory = tmp_path / name
    directory.mkdir()
    (directory / "config.json").write_text("{}")
    return directory


def test_upstream_defaults_and_the_ranks_setting(tmp_path: Path) -> None:
    teacher = model_dir(tmp_path)
    config = parse_config([*BASE, "--use-opd", "--opd-type", "megatron", "--opd-teacher-load", str(teacher)])
    assert config.distill.opd_kl_coef == 1.0 and config.distill.opd_teacher_key == "opd_teacher"
    assert train_settings(config).opd == OpdSettings(type="megatron", kl_coef=1.0, teacher_path=str(teacher))
    assert train_settings(parse_config(BASE)).opd is None
    assert '"opd_teacher_key": "opd_teacher"' in config.to_json()  # a metadata key, not a secret


@pytest.mark.parametrize(("flags", "message"), [
    (["--use-opd"], "--opd-type must be specified"),
    (["--use-opd", "--opd-type", "megatron"], "--opd-teacher-load is required when --opd-type=megatron"),
    (["--opd-teacher-load", "/t"], "--use-opd is not enabled"),
    ([*SGLANG], "needs its teacher: --opd-teacher-urls"),
    ([*SGLANG, "--opd-teacher-urls", "no-equals"], "expected NAME=URL"),
    ([*SGLANG, "--opd-teacher-urls", "a=http://h:1", "a=http://h:2"], "given twice"),
    ([*SGLANG, "--opd-teacher-urls", "a=ftp://h"], "is not a URL"),
    (["--use-opd", "--opd-type", "megatron", "--opd-teacher-load", "/t", "--opd-teacher-urls", "a=http://h:1"],
     "only supported with --opd-type=sglang"),
    (["--custom-rm-path", "slime.rollout.on_policy_distillation.reward_func"], "add --use-opd"),
    (["--opd-type", "teacher"], "--opd-type"),
])
def test_contradictions_fail_at_start_up_naming_the_flags(flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config([*BASE, *flags])


def test_teacher_load_is_checked_on_disk_as_ref_load_is(tmp_path: Path) -> None:
    megatron = tmp_path / "torch_dist"
    megatron.mkdir()
    (megatron / "latest_checkpointed_iteration.txt").write_text("10")
    config = parse_config([*BASE, "--use-opd", "--opd-type", "megatron", "--opd-teacher-load", str(megatron)])
    with pytest.raises(ConfigError, match="Megatron-LM checkpoint"):
        config.distill.teacher_path()
    saves = tmp_path / "saves"
    (saves / "rollout_3").mkdir(parents=True)
    (saves / "rollout_3" / "extra.json").write_text("{}")
    stepped = parse_config([*BASE, "--use-opd", "--opd-type", "megatron", "--opd-teacher-load", str(saves),
                            "--opd-teacher-ckpt-step", "3"])
    assert stepped.distill.teacher_path() == str(saves / "rollout_3")
    missing = parse_config([*BASE, "--use-opd", "--opd-type", "megatron", "--opd-teacher-load", str(saves),
                            "--opd-teacher-ckpt-step", "4"])
    with pytest.raises(ConfigError, match="--opd-teacher-ckpt-step 4: no checkpoint rollout_4"):
        missing.distill.teacher_path()


def test_slimes_single_teacher_is_rm_url_and_miles_routes_by_metadata() -> None:
    slime = parse_config([*BASE, *SGLANG, "--custom-rm-path", "slime.rollout.on_policy_distillation.reward_func",
                          "--rm-url", "http://127.0.0.1:13141/generate"])
    assert slime.distill.teacher_routes(slime.rollout.rm_url) == {"default": "http://127.0.0.1:13141"}
    miles = parse_config([*BASE, *SGLANG, "--opd-teacher-urls", "math=http://h1:30001/generate",
                          "code=http://h2:30002/generate?x=1"])
    routes = miles.distill.teacher_routes(None)
    assert routes == {"math": "http://h1:30001", "code": "http://h2:30002/generate?x=1"}
    scorer = TeacherScorer(client=None, routes=routes)
    assert scorer.route(Sample(metadata={"opd_teacher": "code"})) == "http://h2:30002/generate?x=1"
    with pytest.raises(TeacherError, match="names none of the teachers"):
        scorer.route(Sample(metadata={"opd_teacher": "poetry"}))  # no 'default': never the wrong teacher
    with_default = TeacherScorer(client=None, routes={**routes, "default": "http://h3:1"})
    assert with_default.route(Sample()) == "http://h3:1"
    # --rm-type remote_rm makes --rm-url the reward service, never the teacher
    with pytest.raises(ConfigError, match="needs its teacher"):
        parse_config([*BASE, *SGLANG, "--rm-type", "remote_rm", "--rm-url", "http://h:1/score"])


def test_a_hook_that_asks_the_teacher_itself_needs_no_teacher_address() -> None:
    """slime's contract: with --opd-type sglang a custom generate / rollout / reward hook may fetch the teacher's
    logprobs itself, so no --opd-teacher-urls / --rm-url is needed; slime's own OPD hooks (replaced by rayless'
    teacher) do not count, and a sample the hook left without them fails the rollout naming the hook."""
    for flag in ("--custom-generate-function-path", "--custom-rm-path", "--custom-reward-post-process-path",
                 "--rollout-function-path"):
        config = parse_config([*BASE, *SGLANG, flag, "my_hooks:opd"])
        assert teacher_hook(config.rollout, config.hooks) == flag and config.distill.teacher_routes(None) == {}
    with pytest.raises(ConfigError, match="needs its teacher"):
        parse_config([*BASE, *SGLANG, "--custom-rm-path", "slime.rollout.on_policy_distillation.reward_func"])
    given = Sample(group_index=0, sample_index=0, tokens=[1, 2, 3], response_length=2, teacher_log_probs=[-1.0, -2.0])
    aborted = Sample(group_index=0, sample_index=1, tokens=[1, 2], response_length=1, status=SampleStatus.ABORTED)
    require_teacher_log_probs([given, aborted], hook="--custom-rm-path")
    missing = Sample(group_index=1, sample_index=0, tokens=[1, 2, 3], response_length=2)
    with pytest.raises(TeacherError, match="sample 1/0: --custom-rm-path set no teacher_log_probs for 2 response"):
        require_teacher_log_probs([given, missing], hook="--custom-rm-path")


def test_a_hooks_tensor_of_teacher_logprobs_becomes_floats() -> None:
    sample = Sample(tokens=[1, 2, 3], response_length=2, loss_mask=[1, 1], rollout_log_probs=[0.0, 0.0],
                    teacher_log_probs=torch.tensor([-0.5, -0.25]))  # type: ignore[arg-type]
    settle_teacher_log_probs([sample])
    assert sample.teacher_log_probs == [-0.5, -0.25]
    sample.teacher_log_probs = torch.tensor([-0.5])  # type: ignore[assignment]
    with pytest.raises(TeacherError, match="a hook set 1 teacher_log_probs for 2 response tokens"):
        settle_teacher_log_probs([sample])


def test_the_teacher_is_asked_from_the_prompts_end_and_its_answer_checked() -> None:
    sample = Sample(tokens=[5, 6, 7, 8, 9], response_length=2, loss_mask=[1, 1], rollout_log_probs=[-1.0, -2.0])
    payload = score_payload(sample)
    assert payload["input_ids"] == [5, 6, 7, 8, 9] and payload["return_logprob"] is True
    assert payload["logprob_start_len"] == 2 and payload["sampling_params"]["max_new_tokens"] == 0

    def answer(triples: list[list[object]]) -> GenerateAnswer:  # the teacher's bytes, read as the client reads them
        body = {"text": "", "output_ids": [], "meta_info": {"finish_reason": {"type": "length", "length": 0},
                                                            "output_token_logprobs": [], "input_token_logprobs": triples}}
        return read_generate_answer(json.dumps(body).encode(), "http://teacher", payload, None, DEFAULT_LIMITS)

    assert response_log_probs(answer([[-0.5, 7, None], [-0.25, 8, None], [-0.125, 9, None]]), 2, "t") == [-0.25,
                                                                                                          -0.125]
    with pytest.raises(TeacherError, match=r"has 1 meta_info\.input_token_logprobs, the response has 2"):
        response_log_probs(answer([[-1.0, 9, None]]), 2, "t")
    with pytest.raises(TeacherError, match="not a finite number"):
        response_log_probs(answer([[None, 8, None], [-1.0, 9, None]]), 2, "t")


def test_the_reverse_kl_term_is_slimes_and_only_on_loss_tokens() -> None:
    advantages = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    student = torch.tensor([[9.0, -1.0, -2.0, -3.0]], requires_grad=True)
    teacher = torch.tensor([[0.0, -1.5, -1.0, -3.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    shaped, sums = Distiller(OpdSettings(type="sglang", kl_coef=2.0)).advantages(
        advantages=advantages, student_log_probs=student, teacher_log_probs=teacher, loss_mask=mask)
    assert shaped.tolist() == [[0.0, 1.0 - 2.0 * 0.5, 1.0 - 2.0 * -1.0, 1.0]]
    assert sums == {"opd_reverse_kl": pytest.approx(-0.5)}
    assert not shaped.requires_grad  # the term is a coefficient of the policy gradient, not a loss


def test_teacher_logprobs_reach_the_rank_in_its_layout() -> None:
    samples = [WireSample(tokens=[1, 2, 3], response_length=2, loss_mask=[1, 1], rollout_log_probs=[0.0, 0.0],
                          teacher_log_probs=[-1.0, -2.0]),
               WireSample(tokens=[4, 5], response_length=1, loss_mask=[1], rollout_log_probs=[0.0],
                          teacher_log_probs=[-3.0])]
    tensor = teacher_tensor(samples, [(0, 2), (3, 4)], torch.Size([1, 4]))
    assert tensor.tolist() == [[-1.0, -2.0, 0.0, -3.0]]
    bare = WireSample(tokens=[4, 5], response_length=1, loss_mask=[1], rollout_log_probs=[0.0])
    with pytest.raises(DistillError, match="needs the teacher's logprob"):
        teacher_tensor([bare], [(0, 1)], torch.Size([1, 1]))
    with pytest.raises(msgspec.ValidationError, match=r"opd\.type 'megatron' needs opd\.teacher_path"):
        msgspec.convert({"type": "megatron"}, OpdSettings)  # as the rank decodes its init command


def test_dumps_keep_teacher_logprobs_and_read_older_samples_without_them(tmp_path: Path) -> None:
    distilled = Sample(tokens=[1, 2, 3], response_length=2, loss_mask=[1, 1], rollout_log_probs=[-0.5, -0.25],
                       status=SampleStatus.COMPLETED, reward=0.0, teacher_log_probs=[-0.1, -0.2])
    plain = Sample(sample_index=1, tokens=[1, 2], response_length=1, loss_mask=[1], rollout_log_probs=[-1.0],
                   status=SampleStatus.COMPLETED, reward=0.0)
    path = write_dump(tmp_path / "0.rld", 0, [distilled, plain], config_facts={})
    read = read_dump(path).samples
    assert read[0].teacher_log_probs == [-0.1, -0.2] and read[1].teacher_log_probs is None
    assert WireSample.from_sample(read[0]).teacher_log_probs == [-0.1, -0.2]
    with pytest.raises(SampleError, match="teacher_log_probs has 1 entries, response_length is 2"):
        Sample(tokens=[1, 2, 3], response_length=2, loss_mask=[1, 1], rollout_log_probs=[0.0, 0.0],
               teacher_log_probs=[0.0]).validate()


def test_the_plan_gives_a_served_teacher_its_own_gpus(tmp_path: Path) -> None:
    teacher = model_dir(tmp_path)
    flags = ["--rollout-num-gpus", "2", "--actor-num-gpus-per-node", "2", "--n-samples-per-prompt", "2", *SGLANG, "--opd-teacher-load",
             str(teacher)]
    node = build_plan(parse_config([*BASE[2:], *flags]),
                      GpuInventory.of_count(8, "injected", injected=True), has_sglang=True).local
    (slot,) = node.teacher_engines
    assert slot.name == "teacher-0" and slot.gpus == (4,) and slot.spec.model_path == str(teacher)
    assert [s.gpus for s in node.rollout_engines] == [(2,), (3,)]
    served_elsewhere = build_plan(parse_config([*BASE, *SGLANG, "--rm-url", "http://h:1"]),
                                  GpuInventory.of_count(0, "injected", injected=True), has_sglang=False).local
    assert served_elsewhere.teacher_engines == ()
