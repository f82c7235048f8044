"""A single-turn verifiers environment (`vf.SingleTurnEnv`) with its own dataset: the prompt is a digit, the
answer is that digit. The model's turn ends at its first digit (a stop *regex*: SGLang trims a matched stop
string from the content, a regex match stays in it, so the rubric sees the digit). Reward 1.0 when the digit
is the prompt's. The untrained tiny model scores about 0.03 (most turns end before a digit); copying the
prompt scores 1.0. Measured learning curve: docs/openai.md.

Nothing here imports rayless: `verifiers.load_environment("examples.verifiers_env.echo_env")` loads it as it
loads any environment.
"""

from __future__ import annotations

import re
from typing import Any

import verifiers as vf
from datasets import Dataset

DIGIT = re.compile(r"[0-9]")


def _text(completion: Any) -> str:
    """The assistant text of a completion (verifiers' message models or plain dicts)."""
    if isinstance(completion, str):
        return completion
    parts = []
    for message in completion or []:
        role = getattr(message, "role", None) or (message.get("role") if isinstance(message, dict) else None)
        content = getattr(message, "content", None) if not isinstance(message, dict) else message.get("content")
        if role == "assistant" and isinstance(content, str):
            parts.append(content)
    return "".join(parts)


def first_digit(text: str) -> str:
    match = DIGIT.search(text)
    return match.group(0) if match else ""


async def copied_digit(completion: Any, answer: str, **kwargs: Any) -> float:
    """The rubric: 1.0 when the model's first digit is the answer."""
    return float(first_digit(_text(completion)) == answer)


def dataset(repeats: int = 4) -> Dataset:
    rows = [{"question": str(digit), "answer": str(digit)} for _ in range(repeats) for digit in range(10)]
    return Dataset.from_list(rows)


def load_environment(repeats: int = 4, **kwargs: Any) -> vf.Environment:
    return vf.SingleTurnEnv(dataset=dataset(repeats), rubric=vf.Rubric(funcs=[copied_digit]),
                            sampling_args={"stop_regex": [DIGIT.pattern]}, **kwargs)
