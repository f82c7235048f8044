"""The two example environments as miles agents (`--custom-agent-function-path`), through rayless' generic
verifiers adapter; any other environment is one line like these, or the adapter's own `run_agent` with
RAYLESS_VERIFIERS_ENV naming it (docs/openai.md)."""

from __future__ import annotations

from coordinator.sessions.verifiers_agent import make_agent

run_echo = make_agent("examples.verifiers_env.echo_env")
run_calculator = make_agent("examples.verifiers_env.calculator_env")
