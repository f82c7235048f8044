"""miles' top-k on-policy distillation: the per-token estimate against a reference computed over the whole
vocabulary, the start-up rules, and the rank's use of the precomputed term; the run itself is in
tests/integration/test_distillation.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from coordinator.config import ConfigError, parse_config
from coordinator.config.distill import REWARD_WEIGHT_MODES as WEIGHT_MODES
from coordinator.config.distill import TOP_K_STRATEGIES as STRATEGIES
from coordinator.config.distill import TopK
from coordinator.rollout.teacher_topk import (
    TopKError,
    asked_ids,
    entries_to_map,
    reverse_kl,
    unique_ids,
)
from coordinator.train.settings import train_settings
from replay.format import write_dump
from replay.reader import read_dump
from replay.sample import Sample, SampleError, SampleStatus
from workers.protocol import WireSample
from workers.protocol.train_settings import OpdSettings
from workers.train_rank.distill import Distiller, DistillError, reverse_kl_tensor

BASE = ["--rollout-num-engines", "1", "--hf-checkpoint", "/m", "--num-rollout", "1", "--rollout-batch-size", "1",
        "--prompt-data", "builtin:first_digit", "--run-dir", "/runs/x"]
TOP_K = ["--use-opd", "--opd-type", "sglang", "--rm-url", "http://h:1/generate", "--opd-log-prob-top-k", "3"]
VOCAB, RESPONSE, K = 11, 6, 3


def entries(logprobs: torch.Tensor, ids: list[int]) -> list[list]:
    """SGLang's [logprob, id, text] entries of one position."""
    return [[float(logprobs[i]), i, None] for i in ids]


def reference(student: torch.Tensor, teacher: torch.Tensor, strategy: str, mode: str) -> torch.Tensor:
    """The estimate over the whole vocabulary with boolean masks: the token set from the two top-k masks, the
    weights a (masked) softmax of the chosen side's logprobs — plain exp for xor, whose weights are not
    normalised — and the sum of w * (student - teacher) over the set."""
    s_top = torch.zeros_like(student, dtype=torch.bool).scatter(1, student.topk(K, dim=1).indices, True)
    t_top = torch.zeros_like(teacher, dtype=torch.bool).scatter(1, teacher.topk(K, dim=1).indices, True)
    chosen = {"only-student": s_top, "only-teacher": t_top, "intersection": s_top & t_top, "union": s_top | t_top,
              "xor": s_top ^ t_top}[strategy]
    logps = {"student_p": student, "teacher_p": teacher, "none": torch.zeros_like(student)}[mode]
    if strategy == "xor":
        w = torch.where(chosen, logps.exp(), 0.0)
    else:
        w = torch.softmax(torch.where(chosen, logps, -torch.inf), dim=1).nan_to_num(0.0)
    return (w * (student - teacher)).sum(dim=1)


def estimate(student: torch.Tensor, teacher: torch.Tensor, spec: TopK) -> list[float]:
    """What the scorer computes, from what the engines answer: each side's top-k entries, the teacher's
    logprobs of every id in the student's top-k (one id list for all positions, as the request asks), and the
    student's of every id in the teacher's."""
    s_entries = [entries(row, row.topk(K).indices.tolist()) for row in student]
    t_entries = [entries(row, row.topk(K).indices.tolist()) for row in teacher]
    asked_of_teacher, asked_of_student = unique_ids(s_entries), unique_ids(t_entries)
    return reverse_kl(spec,
                      student_top=[entries_to_map(e) for e in s_entries],
                      teacher_top=[entries_to_map(e) for e in t_entries],
                      teacher_on_student=[entries_to_map(entries(row, asked_of_teacher)) for row in teacher],
                      student_on_teacher=[entries_to_map(entries(row, asked_of_student)) for row in student])


@pytest.mark.parametrize("mode", WEIGHT_MODES)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_estimate_equals_a_whole_vocabulary_reference(strategy: str, mode: str) -> None:
    generator = torch.Generator().manual_seed(7)
    student = torch.log_softmax(torch.randn(RESPONSE, VOCAB, generator=generator, dtype=torch.float64), dim=1)
    teacher = torch.log_softmax(torch.randn(RESPONSE, VOCAB, generator=generator, dtype=torch.float64) * 2, dim=1)
    got = estimate(student, teacher, TopK(K, strategy, mode))
    expected = reference(student, teacher, strategy, mode)
    assert got == pytest.approx(expected.tolist(), abs=1e-9)
    assert any(abs(value) > 1e-3 for value in got)  # the two distributions differ: not a vacuous zero
    # A student equal to its teacher has no reverse KL under any set and weighting.
    assert estimate(student, student, TopK(K, strategy, mode)) == pytest.approx([0.0] * RESPONSE, abs=1e-12)


def test_a_token_neither_side_scored_is_an_error_not_a_guess() -> None:
    spec = TopK(2, "only-student")
    with pytest.raises(TopKError, match="response position 0: no teacher logprob for token id 4"):
        reverse_kl(spec, student_top=[{4: -0.1, 5: -2.0}], teacher_top=[{}], teacher_on_student=[{5: -1.0}],
                   student_on_teacher=[{}])


@pytest.mark.parametrize(("flags", "message"), [
    (["--use-opd", "--opd-type", "megatron", "--opd-teacher-load", "/t", "--opd-log-prob-top-k", "4"],
     "only with --opd-type=sglang"),
    ([*TOP_K, "--custom-generate-function-path", "my.gen:generate"], "use --opd-top-k-strategy only-teacher"),
    (["--use-opd", "--opd-type", "sglang", "--opd-log-prob-top-k", "4", "--custom-generate-function-path",
      "my.gen:generate"], "top-k OPD asks the teacher's engine itself"),
])
def test_top_k_start_up_rules(flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config([*BASE, *flags])


def test_what_each_side_is_asked_for_the_others_ids() -> None:
    """The union of the other side's ids at every position, or (per position) each response position's own ids
    at its input position, the prompt's positions empty."""
    tokens, prompt = [7, 8, 9, 1, 2], 3
    entries = [[[-0.1, 4, None], [-0.2, 6, None]], [[-0.3, 6, None], [-0.4, 5, None]]]
    assert asked_ids(TopK(2), tokens, prompt, entries) == {"token_ids_logprob": [4, 5, 6]}
    assert asked_ids(TopK(2, per_position=True), tokens, prompt, entries) == {
        "token_ids_logprob_positions": [[], [], [], [4, 6], [6, 5]]}
    assert parse_config([*BASE, *TOP_K, "--opd-topk-per-position"]).distill.top_k == TopK(3, per_position=True)


def test_top_k_settings_reach_the_rollout_and_the_ranks() -> None:
    config = parse_config([*BASE, *TOP_K, "--opd-top-k-strategy", "union", "--opd-reward-weight-mode", "teacher_p"])
    assert config.distill.top_k == TopK(3, "union", "teacher_p")
    assert config.distill.student_top_logprobs_num == 3  # the student's top-k are asked during the rollout
    assert train_settings(config).opd == OpdSettings(type="sglang", kl_coef=1.0, top_k=3)
    only_teacher = parse_config([*BASE, *TOP_K, "--opd-top-k-strategy", "only-teacher",
                                 "--custom-generate-function-path", "my.gen:generate"])
    assert only_teacher.distill.student_top_logprobs_num == 0  # a hook's generate may serve it


def test_the_rank_subtracts_the_precomputed_term_on_loss_tokens(tmp_path: Path) -> None:
    samples = [WireSample(tokens=[1, 2, 3], response_length=2, loss_mask=[1, 0], rollout_log_probs=[0.0, 0.0],
                          opd_reverse_kl=[0.5, 9.0]),
               WireSample(tokens=[4, 5], response_length=1, loss_mask=[1], rollout_log_probs=[0.0],
                          opd_reverse_kl=[-0.25])]
    term = reverse_kl_tensor(samples, [(0, 2), (3, 4)], torch.Size([1, 4]))
    assert term.tolist() == [[0.5, 9.0, 0.0, -0.25]]
    mask = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    shaped, sums = Distiller(OpdSettings(type="sglang", kl_coef=2.0, top_k=3)).advantages(
        advantages=torch.ones(1, 4), student_log_probs=None, teacher_log_probs=None, loss_mask=mask,
        reverse_kl=term)
    assert shaped.tolist() == [[0.0, 1.0, 1.0, 1.5]]
    assert sums == {"opd_reverse_kl": pytest.approx(0.25)}
    with pytest.raises(DistillError, match="no opd_reverse_kl"):
        reverse_kl_tensor([WireSample(tokens=[4, 5], response_length=1, loss_mask=[1], rollout_log_probs=[0.0])],
                          [(0, 1)], torch.Size([1, 1]))

    # A dump keeps the term, so a replay trains on it as the run did.
    sample = Sample(tokens=[1, 2, 3], response_length=2, loss_mask=[1, 1], rollout_log_probs=[-0.5, -0.25],
                    status=SampleStatus.COMPLETED, reward=0.0, opd_reverse_kl=[0.1, 0.2])
    read = read_dump(write_dump(tmp_path / "0.rld", 0, [sample], config_facts={})).samples[0]
    assert read.opd_reverse_kl == [0.1, 0.2] and WireSample.from_sample(read).opd_reverse_kl == [0.1, 0.2]
    with pytest.raises(SampleError, match="opd_reverse_kl has 1 entries"):
        Sample(tokens=[1, 2, 3], response_length=2, loss_mask=[1, 1], rollout_log_probs=[0.0, 0.0],
               opd_reverse_kl=[0.0]).validate()
