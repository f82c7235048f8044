"""The SGLang-compatible CPU engine: `python -m workers.engine --model-path DIR --port N` (or `rayless engine`).

Owns nothing itself; it wires the modules below. The HTTP contract is ../shared/SGLANG_CONTRACT.md.
- `args`: launch flags (named as sglang.launch_server's)
- `sampling`: sampling-parameter validation and the batched sampler (raw-logit logprobs)
- `runner`: the Hugging Face model, tokenizer and the batch KV cache (blocking; runs in a worker thread)
- `scheduler`: sequence states and the continuous-batching step loop (event loop side)
- `server`: Starlette routes, auth, weight-update endpoints; uvicorn
- `weight_group`: weight-update groups formed as SGLang's `init_custom_process_group` forms them, SGLang's
  receive loop, and the flattened-bucket layout (shared with the trainer's sender)

Importing this package does not import torch; `main` does.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Parse SGLang-style flags, load the model, then serve until SIGINT/SIGTERM. Returns the exit code."""
    from workers.engine.args import parse_args
    from workers.engine.server import serve

    return serve(parse_args(argv))


__all__ = ["main"]
