"""slime's default per-sample `generate(args, sample, sampling_params)`, written for rayless, for hooks that
call it (a custom generate function delegating one turn, a slime-style rollout function).

One request for the rest of the sample's response through `post` (so through the run's dispatch): the prompt
tokenized when the sample has no tokens yet (chat messages rendered by the chat template first),
`max_new_tokens` less what the sample already generated, the engine's tokens and logprobs appended with
`append_response_tokens`, the status from the finish reason.
"""

from __future__ import annotations

from typing import Any

from coordinator.hooks.http import post
from coordinator.hooks.runtime import SlimeGenerateState
from replay.sample import Sample, SampleStatus


async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any], evaluation: bool = False) -> Sample:
    state = SlimeGenerateState(args)
    if not sample.tokens:
        prompt = sample.prompt
        if not isinstance(prompt, str):
            prompt = state.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        sample.tokens = list(state.tokenizer(prompt, add_special_tokens=False)["input_ids"])
    params = dict(sampling_params)
    params["max_new_tokens"] = int(params.get("max_new_tokens", args.rollout_max_response_len)) - sample.response_length
    if params["max_new_tokens"] <= 0:
        sample.status = SampleStatus.TRUNCATED
        return sample
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    output = await post(url, {"input_ids": sample.tokens, "sampling_params": params, "return_logprob": True})
    triples = output["meta_info"].get("output_token_logprobs") or []
    sample.append_response_tokens(args, tokens=[t[1] for t in triples], log_probs=[t[0] for t in triples],
                                  meta_info=output["meta_info"], text=output.get("text", ""))
    return sample
