"""Prompt and eval data: the files and built-in tasks rollouts and evaluations draw prompts from.

Owns reading `--prompt-data` / eval datasets (`source`) and the built-in tasks (`tasks`). Invariant: it
imports nothing of the coordinator above `config`, so rollout and eval share it without importing each other.
"""
