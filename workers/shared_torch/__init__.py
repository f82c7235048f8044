"""Torch code that both the engine and the training ranks run, so that neither imports the other.

- `token_scores`: next-token logprobs and entropy from the final hidden states, a chunk of positions at a time
  (the ranks' loss, and the engine's rescoring in deterministic runs)
- `weight_group`: weight-update groups as SGLang forms them, its receive loop and the flattened-bucket layout
  (the engine receives, the ranks send)

Importing this package does not import torch; its modules do.
"""
