"""The hooks slice: slime's custom generate function and args-override YAML, miles' multi-turn generate
settings, and the multi-turn metrics switch.

Owns these flags, and each hook kind's time limit and the failure budget (`hook_limits`). Invariants: the miles `--generate-*` settings are read only by the built-in multi-turn
generate (`coordinator.hooks.multi_turn`), so they need `--custom-generate-function-path` naming it (or
miles' path for it, which `porting` rewrites to ours); `--generate-tool-call-parser` names a parser rayless
implements (`TOOL_CALL_PARSERS`, each implemented in `coordinator.hooks.tool_calls`), anything else is refused here, at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.config import values
from coordinator.config.fields import ConfigError, Slice, flag

MULTI_TURN_GENERATE = "coordinator.hooks.multi_turn:generate"
#: miles' `agentic_tool_call.generate`: an OpenAI-API agent through the session server (coordinator.sessions).
AGENTIC_GENERATE = "coordinator.sessions.agentic:generate"
#: `--tito-model` families (all of miles'; the DeepSeek ones render with DeepSeek's own encoders, not a template)
TITO_FAMILIES = ("default", "qwen3", "qwen35", "qwennext", "glm47", "nemotron3", "kimi25", "kimi26", "minimax_m25",
                 "minimax_m27", "inkling", "deepseekv32", "deepseekv4")
MESSAGE_MATCHERS = ("strict", "role_content_only")


#: --generate-tool-call-parser values (`coordinator.hooks.tool_calls` implements each)
TOOL_CALL_PARSERS = ("qwen25", "hermes")


def _tool_call_parsers() -> tuple[str, ...]:
    return TOOL_CALL_PARSERS


@dataclass(frozen=True)
class HooksConfig(Slice):
    TITLE = "hooks"
    DESCRIPTION = "slime-style custom generate functions, miles' multi-turn tool calling, --custom-config-path"

    custom_generate_function_path: str | None = flag(
        None, help="slime's per-sample generate: async fn(args, sample, sampling_params[, evaluation]) -> Sample "
        "(docs/hooks.md)", parse=values.hook_path, metavar="MODULE:NAME")
    custom_config_path: str | None = flag(
        None, help="slime's YAML of args overrides: a key naming a flag sets it (over the command line, with a "
        "warning); any other key becomes an attribute of the args hooks get", metavar="FILE")
    generate_max_turns: int = flag(16, help="miles' multi-turn generate: model turns per sample", minimum=1)
    generate_tool_specs_path: str | None = flag(
        None, help="miles' multi-turn generate: module attribute holding the OpenAI-style tool specs",
        parse=values.hook_path, metavar="MODULE:NAME")
    generate_tool_call_parser: str | None = flag(
        None, help="miles' multi-turn generate: how tool calls are written in the model's text",
        choices=_tool_call_parsers)
    generate_execute_tool_function_path: str | None = flag(
        None, help="miles' multi-turn generate: async fn(name, params) -> str running one tool call",
        parse=values.hook_path, metavar="MODULE:NAME")
    log_multi_turn: bool = flag(False, help="log slime's multi-turn metrics (response length with and "
                                "without tool output, model turns per sample)")
    custom_agent_function_path: str | None = flag(
        None, help="miles' agent: async fn(*, base_url, prompt, request_kwargs, metadata, **kw) -> dict | None, "
        "talking to the policy through the OpenAI API at base_url/v1 (docs/openai.md)", parse=values.hook_path,
        metavar="MODULE:NAME")
    use_session_server: str | None = flag(
        None, help="miles' session server (token in, token out) in the coordinator; bare or v1", choices=("v1", "v2"),
        bare="v1", metavar="[v1]")
    session_server_ip: str = flag("127.0.0.1", help="address the session server listens on")
    session_server_port: tuple[int, ...] = flag((), help="port of the session server (none or 0: the OS picks "
                                                "one)", minimum=0, maximum=65535)
    tito_model: str = flag("default", help="how the session server tokenizes appended messages: default (the "
                           "model's chat template) or a model family of miles' (its boundary tokens and pinned "
                           "template kwargs): " + ", ".join(TITO_FAMILIES[1:]))
    session_message_matcher: str = flag(
        "strict", help="how a session's stored messages are matched against the next request's: strict, "
        "role_content_only, or MODULE:NAME of fn(stored, new) -> bool")
    max_seq_len: int | None = flag(None, help="miles' agent sessions: tokens per trajectory (prompt, turns and "
                                   "tool output); longer ones are cut at a turn boundary", minimum=1)

    # Each hook kind's bounds (coordinator.hooks.calls.HookBounds; docs/hooks.md#bounds-on-user-code).
    agent_timeout_s: float = flag(1800.0, help="seconds one call of the agent (--custom-agent-function-path) may "
                                  "take; past it the episode fails", above=0, metavar="SECONDS")
    custom_generate_timeout_s: float = flag(3600.0, help="seconds one call of --custom-generate-function-path "
                                            "may take; past it the episode fails", above=0, metavar="SECONDS")
    custom_rm_timeout_s: float = flag(300.0, help="seconds one call of --custom-rm-path may take; past it the "
                                      "sample (group, with --group-rm) fails with reward 0.0", above=0,
                                      metavar="SECONDS")
    dynamic_sampling_filter_timeout_s: float = flag(60.0, help="seconds one call of "
                                                    "--dynamic-sampling-filter-path may take; past it the run stops",
                                                    above=0, metavar="SECONDS")
    rollout_function_timeout_s: float = flag(7200.0, help="seconds one call of a slime-style --rollout-function-path "
                                             "or --eval-function-path may take; past it the run stops", above=0,
                                             metavar="SECONDS")
    hook_max_failures_in_a_row: int = flag(64, help="failed calls in a row of one hook kind (an exit, an "
                                           "interrupt, a timeout; an agent's exception or an episode with no "
                                           "model call) that stop the run", minimum=1)

    def hook_limits(self) -> dict[str, float]:
        """Each hook kind's limit (`coordinator.hooks.calls.LIMIT_FLAGS` names the flags)."""
        return {"agent": self.agent_timeout_s, "generate": self.custom_generate_timeout_s,
                "reward": self.custom_rm_timeout_s, "filter": self.dynamic_sampling_filter_timeout_s,
                "rollout": self.rollout_function_timeout_s}

    def check(self) -> None:
        miles = {"--generate-tool-specs-path": self.generate_tool_specs_path,
                 "--generate-execute-tool-function-path": self.generate_execute_tool_function_path,
                 "--generate-tool-call-parser": self.generate_tool_call_parser}
        given = [name for name, value in miles.items() if value is not None]
        missing = [name for name, value in miles.items() if value is None]
        if self.multi_turn_builtin:
            if missing:
                raise ConfigError(f"--custom-generate-function-path {MULTI_TURN_GENERATE} (miles' multi-turn "
                                  f"generate) needs {' and '.join(missing)}")
        elif given:
            raise ConfigError(f"{' '.join(given)} configure miles' multi-turn generate; set "
                              f"--custom-generate-function-path {MULTI_TURN_GENERATE} (or miles' "
                              "miles.rollout.generate_hub.multi_turn.generate) to use them")

        self._check_agent()

    def _check_agent(self) -> None:
        agentic = self.custom_generate_function_path == AGENTIC_GENERATE
        if self.use_session_server == "v2":
            raise ConfigError("--use-session-server v2 (miles' tree-serving sessions) is not implemented in rayless; "
                              "pass it bare (or v1) for the append-only linear server")
        if self.tito_model not in TITO_FAMILIES:
            raise ConfigError(f"--tito-model {self.tito_model!r} is not a TITO family; use one of "
                              f"{', '.join(TITO_FAMILIES)}")
        if self.tito_model != "default" and self.use_session_server is None:
            raise ConfigError(f"--tito-model={self.tito_model} requires --use-session-server; this flag only "
                              "configures the session-server TITO middleware")
        if len(self.session_server_port) > 1:
            raise ConfigError(f"--session-server-port {' '.join(map(str, self.session_server_port))}: miles' range "
                              "of several session servers; rayless runs one session server in the coordinator: "
                              "give one port (or none)")
        matcher = self.session_message_matcher
        if matcher not in MESSAGE_MATCHERS and ("." not in matcher and ":" not in matcher):
            raise ConfigError(f"invalid --session-message-matcher {matcher!r}; use one of "
                              f"{', '.join(MESSAGE_MATCHERS)}, or a dotted import path such as package.module.matcher")
        if agentic and self.custom_agent_function_path is None:
            raise ConfigError(f"--custom-generate-function-path {AGENTIC_GENERATE} (miles' agentic_tool_call) "
                              "needs --custom-agent-function-path naming the agent")
        if agentic and self.use_session_server is None:
            raise ConfigError("agentic_tool_call.generate requires the session server: pass --use-session-server")
        if self.custom_agent_function_path is not None and not agentic:
            raise ConfigError("--custom-agent-function-path is called by miles' agentic generate: set "
                              "--custom-generate-function-path miles.rollout.generate_hub.agentic_tool_call.generate")

    @property
    def multi_turn_builtin(self) -> bool:
        return self.custom_generate_function_path == MULTI_TURN_GENERATE
