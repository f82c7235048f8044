"""miles' built-in multi-turn tool-calling generate, written for rayless (`--custom-generate-function-path
coordinator.hooks.multi_turn:generate`; miles' path `miles.rollout.generate_hub.multi_turn.generate` is
rewritten to this one).

What it does, per sample (miles' `generate_hub.multi_turn.generate`): the prompt rendered by the chat template
with the tool specs (`--generate-tool-specs-path`); up to `--generate-max-turns` model turns, each one
`/generate` request on the whole token list so far (`max_new_tokens` clipped to `--rollout-max-context-len`);
after a turn that stopped normally, the tool calls in its text (`--generate-tool-call-parser`) are run one by
one with `--generate-execute-tool-function-path` (`async fn(name, params) -> str`), and their results, rendered
as `tool` messages by the chat template, are appended with loss mask 0. It stops at a turn without tool calls,
at an abort or the length limit, or after the last turn. `sample.metadata["tool_call_count"]` counts the calls.

Invariant: the sample's tokens are the prompt's followed by each turn's engine tokens and each tool turn's
template tokens, never a re-tokenization of text; model tokens carry the engine's logprobs, tool tokens 0.0.
"""

from __future__ import annotations

from typing import Any

from coordinator.hooks.http import post
from coordinator.hooks.runtime import HookError, SlimeGenerateState
from coordinator.hooks.tool_calls import parse_tool_calls, tokenize_tool_responses
from replay.sample import Sample, SampleStatus
from workers.hook_loading import load_object


def _prompt_ids(state: SlimeGenerateState, sample: Sample, specs: list[dict[str, Any]]) -> list[int]:
    prompt = sample.prompt
    if not isinstance(prompt, str):
        prompt = state.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True,
                                                     tools=specs)
    return list(state.tokenizer(prompt, add_special_tokens=False)["input_ids"])


async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any], evaluation: bool = False) -> Sample:
    if args.partial_rollout:
        raise HookError("miles' multi-turn generate does not continue partial samples (as miles); drop "
                        "--partial-rollout")
    state = SlimeGenerateState(args)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    execute = load_object(args.generate_execute_tool_function_path, what="--generate-execute-tool-function-path")
    specs = load_object(args.generate_tool_specs_path, what="--generate-tool-specs-path")
    params = dict(sampling_params)
    max_new_tokens = int(params.pop("max_new_tokens", args.rollout_max_response_len))

    sample.tokens = _prompt_ids(state, sample, specs)
    sample.response, sample.response_length = "", 0
    sample.loss_mask, sample.rollout_log_probs = [], []
    sample.metadata["tool_call_count"] = 0
    for _turn in range(args.generate_max_turns):
        budget = max_new_tokens
        if args.rollout_max_context_len:
            budget = min(budget, args.rollout_max_context_len - len(sample.tokens))
        if budget <= 0:
            sample.status = SampleStatus.TRUNCATED
            break
        output = await post(url, {"input_ids": sample.tokens, "return_logprob": True,
                                  "sampling_params": {**params, "max_new_tokens": budget}})
        meta = output["meta_info"]
        triples = meta.get("output_token_logprobs") or []
        sample.append_response_tokens(args, tokens=[t[1] for t in triples], log_probs=[t[0] for t in triples],
                                      meta_info=meta, text=output.get("text", ""))
        if meta["finish_reason"]["type"] in ("abort", "length"):
            break
        calls = parse_tool_calls(output.get("text", ""), specs, args.generate_tool_call_parser)
        if not calls:
            break
        messages = []
        for number, call in enumerate(calls):
            result = await execute(call.name, call.arguments)
            if not isinstance(result, str):
                raise HookError(f"--generate-execute-tool-function-path returned {type(result).__name__} for "
                                f"{call.name}; expected the tool's output text")
            messages.append({"role": "tool", "tool_call_id": f"call_{number}", "name": call.name,
                             "content": result})
        sample.metadata["tool_call_count"] += len(calls)
        tool_ids = tokenize_tool_responses(messages, state.tokenizer)
        sample.append_response_tokens(args, tokens=tool_ids, trainable=False,
                                      text=state.tokenizer.decode(tool_ids))
    return sample
