"""Our engine's deterministic pieces on the real tiny model: the batch-invariant runner decodes a sequence to
the same bits whatever shares its batch, and the rescorer's logprobs are the trainer's own, exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from workers.engine.batch_invariant import BatchInvariantRunner
from workers.engine.rescoring import Rescorer
from workers.engine.runner import PrefillItem
from workers.engine.sampling import RowSampling
from workers.shared_torch.token_scores import token_scores
from workers.train_rank.model import load_causal_lm

PROMPT = [3, 17, 42, 5, 9, 11, 2]


def row(seed: int) -> RowSampling:
    return RowSampling(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, generator=torch.Generator().manual_seed(seed))


def generate(runner: BatchInvariantRunner, prompts: dict[str, list[int]], steps: int,
             late: dict[str, list[int]] | None = None) -> dict[str, list[tuple[int, float]]]:
    """Decode every prompt `steps` tokens; `late` prompts join after the first step (a batch that changes)."""
    rows = {key: row(len(key)) for key in [*prompts, *(late or {})]}
    out = runner.step(drop=[], prefills=[PrefillItem(k, p, rows[k]) for k, p in prompts.items()], decode=None)
    drawn = {key: [(o.sample.token, o.sample.logprob)] for key, o in out.items()}
    for step in range(steps):
        joining = [PrefillItem(k, p, rows[k]) for k, p in (late or {}).items()] if step == 0 else []
        out = runner.step(drop=[], prefills=joining, decode={key: rows[key] for key in runner.rows[:len(drawn)]})
        for key, o in out.items():
            drawn.setdefault(key, []).append((o.sample.token, o.sample.logprob))
    runner.reset()
    return drawn


def test_a_sequence_decodes_to_the_same_bits_alone_or_in_any_batch(tiny_model_dir: Path) -> None:
    runner = BatchInvariantRunner(str(tiny_model_dir))
    alone = generate(runner, {"a": PROMPT}, 6)["a"]
    crowded = generate(runner, {"bb": [7] * 13, "a": PROMPT, "c": [4, 4]}, 6, late={"dddd": [8] * 21})
    assert crowded["a"] == alone  # tokens and float logprobs, compared exactly
    assert len(crowded["dddd"]) == 6 and len({tuple(t for t, _ in v) for v in crowded.values()}) > 1


def test_rescored_logprobs_are_the_trainers_exactly(tiny_model_dir: Path) -> None:
    runner = BatchInvariantRunner(str(tiny_model_dir))
    output = [token for token, _ in generate(runner, {"a": PROMPT}, 7)["a"]]
    engine = Rescorer(runner).rescore([(PROMPT, output, None)])[0]
    # the trainer's side: its loader, train mode, autograd on, the same function on the same positions
    model = load_causal_lm(str(tiny_model_dir), dtype=torch.float32, device=torch.device("cpu"), trainable=True)
    model.train()
    tokens = torch.tensor([PROMPT + output])
    scored = torch.zeros((1, tokens.shape[1] - 1), dtype=torch.bool)
    scored[0, len(PROMPT) - 1:] = True
    trainer, _ = token_scores(model, input_ids=tokens, position_ids=torch.arange(tokens.shape[1]).unsqueeze(0),
                              with_entropy=True, scored=scored)
    assert trainer.requires_grad
    assert engine == trainer[0, len(PROMPT) - 1:].tolist()  # equal floats, not close ones
    assert len(engine) == len(output) and all(value < 0 for value in engine)


def test_the_engine_flags_are_sglangs_and_rl_on_policy_target_implies_determinism() -> None:
    from workers.engine.args import parse_args

    args = parse_args(["--model-path", "/m", "--rl-on-policy-target", "fsdp", "--log-probs-chunk-size", "64"])
    assert args.enable_deterministic_inference and args.rl_on_policy_target == "fsdp"
    assert args.log_probs_chunk_size == 64
    assert not parse_args(["--model-path", "/m"]).enable_deterministic_inference
    with pytest.raises(SystemExit) as caught:
        parse_args(["--model-path", "/m", "--log-probs-chunk-size", "64"])
    assert caught.value.code == 2
