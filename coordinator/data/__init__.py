"""Prompt and eval data: the files and built-in tasks rollouts and evaluations draw prompts from.

Owns reading `--prompt-data` / eval datasets (`source`), each row through the boundary layer (`lines`), the
start-up check of a whole file (`check`) and the built-in tasks (`tasks`). Invariant: it imports no other
coordinator package, so rollout, eval and the start-up checks share it without importing each other.
"""
