"""The calculator example's generate and reward functions, written against the slime-shaped hook API: the
same code runs under slime with its three import lines changed back (`slime.rollout.sglang_rollout`,
`slime.utils.http_utils`, `slime.utils.types`).

The task: a prompt `3+4` (two digits, sum below 10). The model's first token either answers at once (a digit)
or asks the calculator (anything else; `=` by convention), which appends its result (`7`) as tool output (loss
mask 0: the model is not trained to write it). Then the model answers with two tokens. Reward: the fraction of
the answer's two characters equal to the sum. The sum is in the context only after a call, so the model learns
to call and to copy what the tool said. A random policy earns ~0.01 (a character right by chance); calling and
copying the result earns 1.0.

    PYTHONPATH=. rayless train --hf-checkpoint runs/tiny-model --config examples/calculator/train.yaml
"""

from __future__ import annotations

from coordinator.hooks import GenerateState, Sample, post
from examples.calculator.tool import calculate

ANSWER_TOKENS = 2


async def _turn(args, sample: Sample, sampling_params: dict, max_new_tokens: int) -> dict:
    """One model turn on the sample's tokens so far; its tokens are appended (trainable, with logprobs)."""
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    output = await post(url, {"input_ids": sample.tokens, "return_logprob": True,
                              "sampling_params": {**sampling_params, "max_new_tokens": max_new_tokens}})
    meta = output["meta_info"]
    pairs = meta["output_token_logprobs"]
    sample.append_response_tokens(args, tokens=[p[1] for p in pairs], log_probs=[p[0] for p in pairs],
                                  trainable=True, meta_info=meta, text=output["text"])
    return output


async def generate(args, sample: Sample, sampling_params) -> Sample:
    assert not args.partial_rollout, "the calculator example generates each sample from its prompt"
    tokenizer = GenerateState(args).tokenizer
    sample.tokens = tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
    sample.response, sample.response_length = "", 0
    sample.loss_mask, sample.rollout_log_probs = [], []
    sample.tool_calls, sample.answer = 0, ""

    first = await _turn(args, sample, sampling_params, 1)
    if first["meta_info"]["finish_reason"]["type"] != "length":  # aborted, or the model ended its turn
        return sample
    if not first["text"].isdigit():  # not an answer: a call
        result = calculate(sample.prompt)
        observation = tokenizer(result, add_special_tokens=False)["input_ids"]
        sample.append_response_tokens(args, tokens=observation, trainable=False, text=result)
        sample.tool_calls = 1
    answer = await _turn(args, sample, sampling_params, ANSWER_TOKENS)
    sample.answer = answer["text"]
    return sample


async def reward_func(args, sample: Sample, **kwargs) -> float:
    """The fraction of the answer's characters equal to the sum."""
    answer = getattr(sample, "answer", "")
    return sum(char == sample.label for char in answer[:ANSWER_TOKENS]) / ANSWER_TOKENS
