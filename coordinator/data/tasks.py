"""Built-in toy tasks for the default job: prompts of three random digits that a tiny model can learn by RL.

Owns the task definitions (prompt format, label, which `--rm-type` scores them). Invariant: the same
(task, n, seed) always yields the same records, so the default job and its tests are reproducible.

Prompts look like `3 7 1=` (digits separated by spaces, then `=`); with the tiny model's character
tokenizer every character is one token, so a prompt is 6 tokens. Tasks (see docs/benchmarks.md):

| task          | label          | reward (`--rm-type`)                                                    |
|---------------|----------------|-------------------------------------------------------------------------|
| `first_digit` | `3`            | `first_digit`: fraction of the first 4 response chars equal to the label |
| `copy`        | `371`          | `char_match`: fraction of label positions matched by the response       |
| `reverse`     | `173`          | `char_match`                                                            |
| `colour`      | `r`            | `first_digit`; an image task for a VLM (`coordinator.data.image_tasks`) |

`--prompt-data builtin:NAME` selects a task without a file (`open_prompt_source`); `write_task_jsonl`
writes one as a file to show the data format.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator.data.source import ChatTokenizer, PromptDataSource, PromptRecord

NUM_DIGITS = 3


@dataclass(frozen=True)
class Task:
    name: str
    rm_type: str
    # digits of the prompt -> label text
    label_of: Callable[[str], str]
    # generated tokens the task is measured with (the default job's --rollout-max-response-len)
    response_length: int
    # the prompts hold images (a vision-language model's task)
    images: bool = False


TASKS: dict[str, Task] = {
    "first_digit": Task("first_digit", "first_digit", lambda digits: digits[0], 4),
    "copy": Task("copy", "char_match", lambda digits: digits, 4),
    "reverse": Task("reverse", "char_match", lambda digits: digits[::-1], 4),
    "colour": Task("colour", "first_digit", lambda digits: "", 4, images=True),
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown built-in task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name]


def make_task_prompts(task: str, n: int, seed: int) -> list[PromptRecord]:
    """`n` prompts of the named task, drawn from `random.Random(seed)`."""
    spec = get_task(task)
    if n < 1:
        raise ValueError(f"a task needs at least one prompt, got n={n}")
    if spec.images:
        from coordinator.data.image_tasks import make_colour_prompts

        return make_colour_prompts(n, seed)
    rng = random.Random(seed)
    records = []
    for index in range(n):
        digits = "".join(rng.choice("0123456789") for _ in range(NUM_DIGITS))
        records.append(
            PromptRecord(
                prompt=" ".join(digits) + "=",
                label=spec.label_of(digits),
                metadata={"task": spec.name},
                index=index,
            )
        )
    return records


def make_first_digit_prompts(n: int, seed: int) -> list[PromptRecord]:
    """The default job's prompts: `3 7 1=` with label `3`."""
    return make_task_prompts("first_digit", n, seed)


def make_copy_prompts(n: int, seed: int) -> list[PromptRecord]:
    return make_task_prompts("copy", n, seed)


def make_reverse_prompts(n: int, seed: int) -> list[PromptRecord]:
    return make_task_prompts("reverse", n, seed)


def write_task_jsonl(path: str | Path, task: str, n: int, seed: int) -> Path:
    """Write a task as `--prompt-data` JSONL (`{"prompt", "label", "metadata"}` per line); returns the path.

    Read it back with `--input-key prompt --label-key label --metadata-key metadata`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for record in make_task_prompts(task, n, seed):
            handle.write(
                json.dumps({"prompt": record.prompt, "label": record.label, "metadata": record.metadata})
                + "\n"
            )
    return path


BUILTIN_PREFIX = "builtin:"
# Prompts drawn for a `builtin:` data source; 3 digits give only 1,000 distinct prompts, so a few thousand
# draws cover them all with the natural repetition of random sampling.
BUILTIN_TASK_SIZE = 4096


def builtin_task_name(prompt_data: str | None) -> str | None:
    """`first_digit` for `--prompt-data builtin:first_digit` (checked), None for a file path."""
    if prompt_data is None or not prompt_data.startswith(BUILTIN_PREFIX):
        return None
    return get_task(prompt_data.removeprefix(BUILTIN_PREFIX)).name


def is_image_task(prompt_data: str | None) -> bool:
    """Whether `--prompt-data` is a built-in task whose prompts hold images."""
    task = builtin_task_name(prompt_data)
    return task is not None and TASKS[task].images


def open_prompt_source(
    prompt_data: str,
    *,
    apply_chat_template: bool = False,
    tokenizer: ChatTokenizer | None = None,
    shuffle: bool,
    seed: int,
    **file_options: Any,
) -> PromptDataSource:
    """The data source for a `--prompt-data` value: a built-in task (`builtin:NAME`) or a JSONL/Parquet file.

    A built-in task's prompts are drawn from `seed`, so the same `--rollout-seed` gives the same data.
    `file_options` are `PromptDataSource`'s for a file (input_key, label_key, metadata_key, raw_prompts,
    max_line_bytes); a built-in task's records have their own keys and sizes.
    """
    task = builtin_task_name(prompt_data)
    if task is None:
        return PromptDataSource(prompt_data, apply_chat_template=apply_chat_template, tokenizer=tokenizer,
                                shuffle=shuffle, seed=seed, **file_options)
    from coordinator.data.image_tasks import COLOUR_TASK_SIZE

    return PromptDataSource.from_records(
        make_task_prompts(task, COLOUR_TASK_SIZE if TASKS[task].images else BUILTIN_TASK_SIZE, seed),
        apply_chat_template=apply_chat_template,
        tokenizer=tokenizer,
        shuffle=shuffle,
        seed=seed,
        source=prompt_data,
        render_images=bool(file_options.get("render_images", True)),
    )
