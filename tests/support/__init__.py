"""What tests and benchmarks share; no test module imports another test module, only this package.

- `engine_proc`: start a real CPU engine process and always stop it.
- `fake_engine`: a FAKE in-process engine for failures a real one cannot show on demand.
- `generate_contract`: the /generate contract checks run against an engine directly and through the router.
- `orphans`: the pytest plugin that fails a session leaving child processes behind.
- `processes`: which of a run's processes still run (`alive`, `wait_gone`) and the bound after a stop.
- `replay_inputs`: dumps and a malicious pickle payload for the replay tests.
- `rollout_fns`: rollout functions loaded through --rollout-function-path / --custom-rm-path.
- `train_samples`: synthetic training samples and the train group's base config.
- `waiting`: `wait_until` / `wait_until_sync`, the one way a test waits for a condition (with a deadline).
"""
