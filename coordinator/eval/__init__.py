"""Evaluation: eval datasets' settings, one evaluation's run, the dedicated eval fleet with its checkpoint
pinning, and slime's default evaluation on the rollout engines. Imports rollout, rewards and engines; nothing
below imports it."""
