"""miles' agent flags at start-up: accepted as miles spells them (bare `--use-session-server`, miles'
agentic generate path resolving to ours), and miles' checks refusing the contradictions before anything runs."""

from __future__ import annotations

import pytest

from coordinator.config import parse_config
from coordinator.config.fields import ConfigError
from coordinator.config.hooks import AGENTIC_GENERATE

BASE = ["--hf-checkpoint", "/nonexistent-model", "--prompt-data", "x.jsonl", "--rollout-num-engines", "1",
        "--actor-num-gpus-per-node", "1", "--rollout-batch-size", "2", "--num-rollout", "1"]
AGENT = ["--custom-generate-function-path", "miles.rollout.generate_hub.agentic_tool_call.generate",
         "--custom-agent-function-path", "my_agents.swe.run_agent"]


def test_miles_agent_flags_parse_as_miles_spells_them() -> None:
    hooks = parse_config([*BASE, *AGENT, "--use-session-server", "--tito-model", "qwen3", "--max-seq-len", "4096",
                          "--session-server-port", "0", "--session-message-matcher", "role_content_only"]).hooks
    assert hooks.custom_generate_function_path == AGENTIC_GENERATE
    assert hooks.use_session_server == "v1" and hooks.tito_model == "qwen3" and hooks.max_seq_len == 4096
    assert parse_config([*BASE, *AGENT, "--use-session-server", "v1"]).hooks.use_session_server == "v1"
    for family in ("qwen35", "qwennext", "glm47", "nemotron3", "kimi25", "kimi26", "minimax_m25", "minimax_m27",
                   "inkling", "deepseekv32", "deepseekv4"):  # miles' families beyond qwen3 (test_session_tito.py,
        # test_deepseek_encoding.py: their layouts)
        assert parse_config([*BASE, *AGENT, "--use-session-server", "--tito-model", family]).hooks.tito_model == family


@pytest.mark.parametrize(("flags", "words"), [
    ([*AGENT, "--use-session-server", "v2"], "v2"),
    ([*AGENT, "--use-session-server", "v3"], "--use-session-server"),
    (["--tito-model", "qwen3"], "requires --use-session-server"),
    ([*AGENT, "--use-session-server", "--tito-model", "gpt9"], "not a TITO family"),
    ([*AGENT, "--use-session-server", "--pause-generation-mode", "abort"], "--pause-generation-mode=abort"),
    ([*AGENT], "requires the session server"),
    (["--use-session-server", "--custom-agent-function-path", "a.b.c"], "agentic_tool_call.generate"),
    (["--use-session-server", "--custom-generate-function-path",
      "miles.rollout.generate_hub.agentic_tool_call.generate"], "--custom-agent-function-path"),
    ([*AGENT, "--use-session-server", "--session-message-matcher", "fuzzy"], "--session-message-matcher"),
    ([*AGENT, "--use-session-server", "--max-seq-len", "0"], "--max-seq-len"),
    ([*AGENT, "--use-session-server", "--session-server-port", "30000", "30010"], "one session server"),
])
def test_miles_checks_refuse_contradictions_at_start_up(flags: list[str], words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace("-", r"\-").replace(".", r"\.")):
        parse_config([*BASE, *flags])


async def test_the_agents_abort_hook_is_called_when_it_exists() -> None:
    import argparse

    from coordinator.rollout.agent_abort import call_agent_abort_hook
    from coordinator.sessions.agentic import build_chat_request_kwargs
    from tests.support import session_agent

    args = argparse.Namespace(custom_agent_function_path="tests.support.session_agent.run_agent")
    await call_agent_abort_hook(args)
    assert session_agent.ABORTED == [args]
    await call_agent_abort_hook(argparse.Namespace(custom_agent_function_path="coordinator.sessions.tito:Matcher"))
    assert build_chat_request_kwargs({"max_new_tokens": 8, "min_new_tokens": 1, "sampling_seed": 3, "stop": ["x"],
                                      "stop_token_ids": [2], "no_stop_trim": True, "temperature": 1.0,
                                      "spaces_between_special_tokens": False, "top_k": None}) == {
        "max_tokens": 8, "min_tokens": 1, "seed": 3, "stop": ["x"], "stop_token_ids": [2], "no_stop_trim": True,
        "temperature": 1.0}


def test_the_agent_and_matcher_are_checked_at_start_up() -> None:
    from coordinator.checks.preflight import check_hooks

    def config(agent: str, matcher: str = "strict") -> object:
        return parse_config([*BASE, "--use-session-server", "--custom-generate-function-path",
                             "miles.rollout.generate_hub.agentic_tool_call.generate",
                             "--custom-agent-function-path", agent, "--session-message-matcher", matcher])

    notes = check_hooks(config("tests.support.session_agent.run_agent", "coordinator.sessions.tito:strict_matches"))
    assert any(note.startswith("--custom-agent-function-path") for note in notes)
    assert any(note.startswith("--session-message-matcher") for note in notes)
    with pytest.raises(ConfigError, match="cannot be called as miles calls an agent"):
        check_hooks(config("coordinator.sessions.tito:strict_matches"))
    with pytest.raises(ConfigError, match="--custom-agent-function-path"):
        check_hooks(config("tests.support.no_such_module.run_agent"))
    with pytest.raises(ConfigError, match="stored_message, new_message"):
        check_hooks(config("tests.support.session_agent.run_agent", "tests.support.session_agent:calculator"))
