"""On-policy distillation end to end: a tiny student is pulled towards a different tiny teacher.

Both teacher types on real processes: `sglang` (the teacher served by a CPU engine that rayless launches from
`--opd-teacher-load`, asked during the rollout) and `megatron` (the teacher loaded on the torchrun rank). The student and the
teacher are tiny models of different seeds, the teacher taught to prefer one token, so the KL between the two
is large and a few rollouts can move it. The reward is pure distillation's 0: the only learning signal is the
reverse-KL term. The sglang run's dumps hold the teacher
logprobs, and replaying them trains the same first step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from coordinator.config import parse_config
from coordinator.observe.progress import read_metrics
from coordinator.run import run_training
from replay.format import dump_path
from replay.reader import read_dump
from workers.tiny_model import TinyModelSpec, build_tiny_model, vocabulary

ROLLOUTS = 6
COMMON = ["--prompt-data", "builtin:first_digit", "--rollout-batch-size", "8", "--n-samples-per-prompt", "4",
          "--rollout-max-response-len", "8", "--rollout-shuffle", "--lr", "4e-2", "--no-progress",
          "--actor-num-gpus-per-node", "1", "--custom-rm-path", "coordinator.rollout.teacher:distill_reward",
          "--use-opd", "--opd-kl-coef", "1.0"]


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another seed, then taught (10 Adam steps of cross-entropy on random contexts) to prefer the token '7':
    a teacher the student's sampled tokens can be measured against, and whose preference a few rollouts of
    distillation can pass on."""
    from transformers import AutoModelForCausalLM

    directory = build_tiny_model(tmp_path_factory.mktemp("teacher"), TinyModelSpec(seed=1))
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    vocab = vocabulary()
    generator = torch.Generator().manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    for _ in range(10):
        contexts = torch.randint(0, len(vocab), (16, 16), generator=generator)
        logits = model(contexts).logits
        target = torch.full((logits.shape[0] * logits.shape[1],), vocab["7"])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(str(directory), safe_serialization=True)
    return directory


def reverse_kls(run_dir: Path) -> list[float]:
    return [row["train/opd_reverse_kl"] for row in read_metrics(run_dir / "metrics.jsonl")]


def assert_pulled_towards_the_teacher(run_dir: Path) -> list[float]:
    kls = reverse_kls(run_dir)
    assert len(kls) == ROLLOUTS, kls
    first = sum(kls[:2]) / 2
    assert first > 1.0, kls  # the two models really differ
    assert min(kls[-2:]) < 0.6 * first, kls  # and the student came much closer
    return kls


@pytest.mark.anyio
async def test_sglang_teacher_pulls_the_student_and_its_logprobs_replay(
        tiny_model_dir: Path, teacher_dir: Path, tmp_path: Path) -> None:
    """rayless serves the teacher from --opd-teacher-load on an engine of its own (group "teacher")."""
    run_dir = tmp_path / "sglang"
    template = str(run_dir / "dumps" / "{rollout_id}.rld")
    config = parse_config(["--hf-checkpoint", str(tiny_model_dir), "--run-dir", str(run_dir), *COMMON,
                           "--opd-type", "sglang", "--opd-teacher-load", str(teacher_dir),
                           "--rollout-num-engines", "1", "--num-rollout", str(ROLLOUTS),
                           "--save-debug-rollout-data", template])
    summary = await run_training(config)
    assert summary["train_steps"] == ROLLOUTS
    kls = assert_pulled_towards_the_teacher(run_dir)

    # The dump holds the teacher's logprob of every response token; on the first rollout the student's are the
    # engine's (the same weights), so the logged reverse KL is their token mean over the dump.
    samples = read_dump(dump_path(template, 0)).samples
    assert all(s.teacher_log_probs is not None and len(s.teacher_log_probs) == s.response_length for s in samples)
    diffs = [(student - teacher) * mask for s in samples
             for student, teacher, mask in zip(s.rollout_log_probs, s.teacher_log_probs, s.loss_mask, strict=True)]
    tokens = sum(sum(s.loss_mask) for s in samples)
    assert kls[0] == pytest.approx(sum(diffs) / tokens, abs=1e-3)

    replay_dir = tmp_path / "replay"
    replay = parse_config(["--hf-checkpoint", str(tiny_model_dir), "--run-dir", str(replay_dir), *COMMON,
                           "--opd-type", "sglang", "--load-debug-rollout-data", template, "--num-rollout", "1"])
    await run_training(replay)
    assert reverse_kls(replay_dir) == pytest.approx(kls[:1], abs=1e-6)


@pytest.mark.anyio
async def test_megatron_teacher_on_the_ranks_pulls_the_student(tiny_model_dir: Path, teacher_dir: Path,
                                                               tmp_path: Path) -> None:
    run_dir = tmp_path / "megatron"
    config = parse_config(["--hf-checkpoint", str(tiny_model_dir), "--run-dir", str(run_dir), *COMMON,
                           "--opd-type", "megatron", "--opd-teacher-load", str(teacher_dir),
                           "--rollout-num-engines", "1", "--num-rollout", str(ROLLOUTS)])
    summary = await run_training(config)
    assert summary["train_steps"] == ROLLOUTS
    assert_pulled_towards_the_teacher(run_dir)


def full_log_probs(directory: Path, tokens: list[int]) -> torch.Tensor:
    """A model's log_softmax over the vocabulary at every position of `tokens` (row i predicts token i + 1)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([tokens])).logits[0].double(), dim=-1)


@pytest.mark.anyio
async def test_top_k_opd_trains_on_the_estimate_the_two_models_give(tiny_model_dir: Path, teacher_dir: Path,
                                                                     tmp_path: Path) -> None:
    """miles' top-k OPD with the `union` set, which reads everything the strategies ask for: the student's
    top-k of each generated token (asked during the rollout), the teacher's top-k and its logprobs of the
    student's ids, and the student engine's logprobs of the teacher's ids. The first rollout's estimate is
    recomputed here from the two models over the whole vocabulary, and the ranks train on exactly it.

    No pull towards the teacher is asserted: miles' estimate at a position does not depend on the token sampled
    there, so as an advantage term its expected policy gradient is zero (docs/distillation.md)."""
    run_dir = tmp_path / "top-k"
    template = str(run_dir / "dumps" / "{rollout_id}.rld")
    config = parse_config(["--hf-checkpoint", str(tiny_model_dir), "--run-dir", str(run_dir), *COMMON,
                           "--opd-type", "sglang", "--opd-teacher-load", str(teacher_dir),
                           "--opd-log-prob-top-k", "4", "--opd-top-k-strategy", "union",
                           "--rollout-num-engines", "1", "--num-rollout", "2", "--save-debug-rollout-data", template])
    summary = await run_training(config)
    assert summary["train_steps"] == 2
    kls = reverse_kls(run_dir)

    samples = read_dump(dump_path(template, 0)).samples
    for s in samples:
        tops = s.metadata["opd_student_top_logprobs"]
        assert len(tops) == s.response_length and all(len(entry) == 4 for entry in tops)
        assert s.opd_reverse_kl is not None and len(s.opd_reverse_kl) == s.response_length
        assert s.teacher_log_probs is None
    terms = [value * mask for s in samples for value, mask in zip(s.opd_reverse_kl, s.loss_mask, strict=True)]
    assert kls[0] == pytest.approx(sum(terms) / sum(sum(s.loss_mask) for s in samples), abs=1e-5)
    assert kls[0] > 0.5, kls  # the two models differ over their top tokens too

    sample = max(samples, key=lambda s: s.response_length)
    rows = slice(sample.prompt_length - 1, len(sample.tokens) - 1)  # the rows that predict the response
    student = full_log_probs(tiny_model_dir, sample.tokens)[rows]
    teacher = full_log_probs(teacher_dir, sample.tokens)[rows]
    union = torch.zeros_like(student, dtype=torch.bool)
    union.scatter_(1, student.topk(4, dim=1).indices, True).scatter_(1, teacher.topk(4, dim=1).indices, True)
    weights = torch.softmax(torch.where(union, student, -torch.inf), dim=1)  # student_p, normalised over the set
    expected = (weights * (student - teacher)).sum(dim=1)
    assert sample.opd_reverse_kl == pytest.approx(expected.tolist(), abs=1e-4)
