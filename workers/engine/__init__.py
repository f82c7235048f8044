"""The SGLang-compatible engine: `python -m workers.engine --model-path DIR --port N` (or `rayless engine`), on the
CPU by default or a GPU (`--device cuda`).

Owns nothing itself; it wires the modules below. The HTTP contract is in docs/engine.md.
- `args`: launch flags (named as sglang.launch_server's)
- `sampling_params`: SGLang 0.5.x's SamplingParams: every field, its validation and messages
- `sampling`: the batched sampler (raw-logit logprobs; penalties, bias, filters)
- `stops`: finish checks (stop strings, stop regexes, stop tokens, length) and stop trimming, as SGLang
- `runner`: the Hugging Face model, tokenizer and the batch KV cache on one device (blocking; worker thread)
- `memory`: releasing the weights for real and restoring the current ones bit-identically
- `sequences`: the records of generation (`Seq`, `RequestGroup`) and `MemoryReleasedError`
- `scheduler`: sequence states and the continuous-batching step loop (event loop side)
- `http_input`: the API key, bounded request bodies (size, JSON depth) and clients that disconnect mid-body
- `replies`: the error shapes every route module answers with
- `server`: the engine's state, the route table built from the route modules below, the lifespan; uvicorn
- `generate_routes` (`/generate`, its responses and streams), `generate_request` (a body validated into
  sequences), `info_routes` (health, info, metrics), `control_routes` (pause, continue, abort, flush),
  `memory_routes` (release/resume), `weight_routes` (weight updates and weight-update groups)
- `openai_routes`, `openai_protocol`, `openai_render`: the OpenAI-compatible `/v1/chat/completions`,
  `/v1/completions` and `/v1/models` (requests mapped onto /generate's validation; SGLang's response shapes)
- `anthropic_routes` / `anthropic_protocol` / `anthropic_replies` and `responses_routes` / `responses_protocol` /
  `responses_replies`: Anthropic's `/v1/messages` and OpenAI's `/v1/responses` as chat turns (`assistant_turns`);
  the protocol and reply modules, with `finished_turns` and `tool_call_text`, import no torch (the coordinator's
  session server answers in the same shapes)
- weight-update groups (SGLang's `init_custom_process_group`, its receive loop, the flattened-bucket layout)
  live in `workers.shared_torch.weight_group`, shared with the trainer's sender

Importing this package does not import torch; `main` does.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Parse SGLang-style flags, load the model, then serve until SIGINT/SIGTERM. Returns the exit code."""
    import sys

    from workers.engine.args import model_path_problem, parse_args

    args = parse_args(argv)
    problem = model_path_problem(args.model_path)
    if problem:  # before torch is imported: a bad path fails at once, not after seconds of imports
        print(f"rayless engine: cannot load the model from {args.model_path}: {problem}", file=sys.stderr)
        return 2
    from workers.engine.server import serve

    return serve(args)


__all__ = ["main"]
