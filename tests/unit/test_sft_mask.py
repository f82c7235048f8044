"""SFT's loss mask against slime's own rule: `coordinator.rollout.sft_mask` and slime's
`MultiTurnLossMaskGenerator` (tests/data/slime_ports/mask_utils, unchanged) give the same token ids and masks on
multi-turn chats, for every `--loss-mask-type`, with the tiny model's template and a Qwen2.5-style one that adds
a default system prompt to every message rendered alone; and the trained tokens are exactly the assistant turns.
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path
from typing import Any

import pytest

from coordinator.rollout.sft_mask import ChatLossMask, LossMaskError, response_length

SLIME_MASK_UTILS = Path(__file__).parents[1] / "data" / "slime_ports" / "mask_utils" / "mask_utils.py"

#: Qwen2.5's rule: a chat that does not open with a system message gets the default one.
SYSTEM_DEFAULT_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
    [{"role": "system", "content": "Be short."}, {"role": "user", "content": "Name a color."},
     {"role": "assistant", "content": "red"}, {"role": "user", "content": "Another?"},
     {"role": "assistant", "content": "blue, or green"}],
    [{"role": "user", "content": "count"}, {"role": "assistant", "content": "1 2", "step_loss_mask": 0},
     {"role": "user", "content": "again"}, {"role": "assistant", "content": "1 2 3"}],
    [{"role": "user", "content": "look it up"}, {"role": "assistant", "content": "call(x)"},
     {"role": "tool", "content": "A"}, {"role": "tool", "content": "B"}, {"role": "assistant", "content": "AB"}],
]


def _slime_generator() -> Any:
    spec = importlib.util.spec_from_file_location("slime_mask_utils", SLIME_MASK_UTILS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.MultiTurnLossMaskGenerator


@pytest.fixture(scope="module", params=["tiny", "system-default"])
def tokenizer(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(tiny_model_dir)
    if request.param == "system-default":
        loaded.chat_template = SYSTEM_DEFAULT_TEMPLATE
    return loaded


@pytest.mark.parametrize("mask_type", ["qwen", "qwen3", "qwen3_5", "distill_qwen"])
def test_every_rule_matches_slimes_generator_on_multi_turn_chats(tokenizer: Any, mask_type: str) -> None:
    ours = ChatLossMask(tokenizer, mask_type)
    theirs = _slime_generator()(tokenizer, tokenizer_type=mask_type)
    compared = 0
    for chat in CHATS:
        slime_ids, slime_mask = theirs.get_loss_mask(copy.deepcopy(chat))
        if len(slime_ids) != len(slime_mask):  # the rule does not fit the template: slime's SFT rollout stops
            with pytest.raises(LossMaskError, match=f"--loss-mask-type {mask_type} does not fit"):
                ours(copy.deepcopy(chat))
            continue
        token_ids, loss_mask = ours(copy.deepcopy(chat))
        assert (token_ids, loss_mask) == (slime_ids, slime_mask), (mask_type, chat)
        assert response_length(loss_mask) == theirs.get_response_lengths([loss_mask])[0]
        compared += 1
    assert compared or (mask_type, tokenizer.chat_template) == ("qwen3", SYSTEM_DEFAULT_TEMPLATE)


def test_only_the_assistant_turns_are_trained_every_one_of_them(tokenizer: Any) -> None:
    """Behaviour, whatever slime does: the trained spans decode to each trained assistant turn's content and end
    marker, in order; the user, system and tool turns, the headers and a step_loss_mask-0 turn are not trained."""
    mask = ChatLossMask(tokenizer, "qwen")
    for chat in CHATS:
        token_ids, loss_mask = mask(chat)
        spans: list[list[int]] = []
        previous = 0
        for token, trained in zip(token_ids, loss_mask, strict=True):
            if trained and not previous:
                spans.append([])
            if trained:
                spans[-1].append(token)
            previous = trained
        texts = [tokenizer.decode(span) for span in spans]
        expected = [f"{m['content']}<|im_end|>\n" for m in chat if m["role"] == "assistant"
                    and m.get("step_loss_mask", 1) == 1]
        assert texts == expected, chat
        assert tokenizer.decode(token_ids).endswith(expected[-1])


def test_a_template_the_rule_cannot_measure_is_a_clear_error(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = "{% for message in messages %}{{ message['role'] }}{% endfor %}"  # drops content
    with pytest.raises(LossMaskError, match="--loss-mask-type qwen"):
        ChatLossMask(tokenizer, "qwen")
