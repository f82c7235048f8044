"""The hooks slice: slime's custom generate function and args-override YAML, miles' multi-turn generate
settings, and the multi-turn metrics switch.

Owns these flags. Invariants: the miles `--generate-*` settings are read only by the built-in multi-turn
generate (`coordinator.hooks.multi_turn`), so they need `--custom-generate-function-path` naming it (or
miles' path for it, which `porting` rewrites to ours); `--generate-tool-call-parser` names a parser rayless
implements (`TOOL_CALL_PARSERS`, each implemented in `coordinator.hooks.tool_calls`), anything else is refused here, at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.config import values
from coordinator.config.fields import ConfigError, Slice, flag

MULTI_TURN_GENERATE = "coordinator.hooks.multi_turn:generate"


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
        "(README: 'Hooks')", parse=values.hook_path, metavar="MODULE:NAME")
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

    @property
    def multi_turn_builtin(self) -> bool:
        return self.custom_generate_function_path == MULTI_TURN_GENERATE
