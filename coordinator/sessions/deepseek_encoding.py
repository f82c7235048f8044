"""DeepSeek V3.2 and V4 prompts: OpenAI-style messages to the text DeepSeek's own message encoders write.

Neither model ships a chat template; their prompts come from DeepSeek's `encoding_dsv32` (miles vendors it with
`drop_thinking` honoured at render time) and `encoding_dsv4` (SGLang's `srt/entrypoints/openai`), which miles'
`--tito-model deepseekv32` / `deepseekv4` render through (`miles/utils/chat_template_utils/deepseek.py`). Owns
that rendering, written here from their rules: the special tokens, the DSML tool-call blocks, the tools
section text, where the thinking opener or closer goes, V4's tool results folded into the next user turn, the
generation prompt a render without one leaves off, and the thinking mode the kwargs resolve to (miles'
`_build_encode_config`: `thinking_mode`, else `enable_thinking`, else `thinking`, else thinking on).

Invariant: rendered with `drop_thinking=False` (miles pins it for both families, as TITO needs), every earlier
turn renders the same whatever is appended after it, so a render of history plus new messages starts with the
render of the history: what `coordinator.sessions.tito` relies on. Messages the encoders reject (a tool result
without a tool call, an empty developer message, an unknown role) raise `DeepSeekEncodingError`.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence

from workers.boundary.json_input import JsonObject, JsonValue
from workers.errors import RaylessError

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"

#: the kwargs that choose the thinking mode (miles' `_DEEPSEEK_MODE_KWARG_ALIASES`)
MODE_KWARGS = ("thinking_mode", "enable_thinking", "thinking")

_RESPONSE_FORMAT = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{schema}"

_V32_TOOLS = """## Tools
You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "<{dsml}function_calls>" block like the following as part of your reply to the user:
<{dsml}function_calls>
<{dsml}invoke name="$FUNCTION_NAME">
<{dsml}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}parameter>
...
</{dsml}invoke>
<{dsml}invoke name="$FUNCTION_NAME2">
...
</{dsml}invoke>
</{dsml}function_calls>
String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" for other types (numbers, booleans, arrays, objects).
If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking block. Here is an example:
<{dsml}function_calls>
...
</{dsml}function_calls>
<function_results>
...
</function_results>
{think_start}...thinking about results{think_end}
Here are the functions available in JSONSchema format:
<functions>
{schemas}
</functions>
"""  # the model's own prompt text, line for line

_V4_TOOLS = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{dsml}tool_calls>" block like the following:

<{dsml}tool_calls>
<{dsml}invoke name="$TOOL_NAME">
<{dsml}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}parameter>
...
</{dsml}invoke>
<{dsml}invoke name="$TOOL_NAME2">
...
</{dsml}invoke>
</{dsml}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {think_start}), you MUST output your complete reasoning inside {think_start}...{think_end} BEFORE any tool calls or final response.

Otherwise, output directly after {think_end} with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""  # the model's own prompt text, line for line

_V4_REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)

#: the fields of SGLang's `Function` (a tool's `function`), in its declaration order
_FUNCTION_FIELDS = ("description", "name", "parameters", "strict", "defer_loading")


class DeepSeekEncodingError(RaylessError, ValueError):
    """Messages DeepSeek's encoder cannot render."""


def _json(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)


def tool_schema(tool: JsonValue) -> JsonObject:
    """A request's tool as the encoder prints it: its `function`, as SGLang's `Tool` model dumps it (miles
    round-trips tools through it): the client's keys in its order, `description` and `parameters` null when left
    out, `strict` / `defer_loading` only when given, keys `Function` does not have dropped."""
    if not isinstance(tool, Mapping) or not isinstance(tool.get("function"), Mapping) \
            or not isinstance(tool["function"].get("name"), str):
        raise DeepSeekEncodingError(f"a tool must be {{'type': 'function', 'function': {{'name': ...}}}}, got {tool!r}")
    given = tool["function"]
    data = {key: given.get(key) for key in _FUNCTION_FIELDS}
    for key in ("strict", "defer_loading"):
        if data[key] is None:
            del data[key]
    order = [key for key in given if key in data] + [key for key in data if key not in given]
    return {key: data[key] for key in order}


def _arguments(call: Mapping[str, JsonValue], *, lenient: bool) -> Mapping[str, JsonValue]:
    """A tool call's arguments as a mapping: a JSON string is parsed (miles hands the encoders JSON strings, a
    mapping turned into one). V4 (`lenient`) wraps a string that is not JSON as `{"arguments": raw}`, as its
    encoder does; V3.2 refuses it; JSON that is no object is refused by both (their encoders fail on it)."""
    raw = call.get("arguments")
    parsed: JsonValue = raw
    if isinstance(raw, str):
        try:
            parsed = json.loads(raw)
        except ValueError:
            if lenient:
                return {"arguments": raw}
            raise DeepSeekEncodingError(f"tool call {call.get('name')!r}: arguments are not JSON: {raw!r}") from None
    if not isinstance(parsed, Mapping):
        raise DeepSeekEncodingError(f"tool call {call.get('name')!r}: function.arguments must be a JSON object")
    return parsed


def _dsml_invoke(call: Mapping[str, JsonValue], *, lenient: bool) -> str:
    parameters = "\n".join(
        f'<{DSML}parameter name="{key}" string="{"true" if isinstance(value, str) else "false"}">'
        f"{value if isinstance(value, str) else _json(value)}</{DSML}parameter>"
        for key, value in _arguments(call, lenient=lenient).items())
    return f'<{DSML}invoke name="{call.get("name")}">\n{parameters}\n</{DSML}invoke>'


def _tool_calls_block(message: JsonObject, block: str, *, lenient: bool) -> str:
    calls = message.get("tool_calls")
    if not calls:
        return ""
    if not isinstance(calls, list):
        raise DeepSeekEncodingError("an assistant message's tool_calls must be a list")
    invokes = []
    for call in calls:
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping):
            raise DeepSeekEncodingError(f"a tool call needs a function: {call!r}")
        invokes.append(_dsml_invoke(function, lenient=lenient))
    return f"\n\n<{DSML}{block}>\n" + "\n".join(invokes) + f"\n</{DSML}{block}>"


def _text(value: JsonValue) -> str:
    return "" if value is None else str(value)


def _sections(message: JsonObject, template: str) -> str:
    """A system or developer message's tools section and response format, each after a blank line."""
    out = ""
    if tools := message.get("tools"):
        assert isinstance(tools, list)
        schemas = "\n".join(_json(tool["function"]) for tool in tools if isinstance(tool, Mapping))
        out += "\n\n" + template.format(dsml=DSML, think_start=THINK_START, think_end=THINK_END, schemas=schemas)
    if message.get("response_format"):
        out += "\n\n" + _RESPONSE_FORMAT.format(schema=_json(message["response_format"]))
    return out


def with_tools(messages: Sequence[JsonObject], tools: Sequence[JsonValue] | None) -> list[JsonObject]:
    """`tools` put in the first message, a system message (an empty one inserted when there is none), where the
    encoders read them (miles' `_inject_tools_into_system`)."""
    out = copy.deepcopy(list(messages))
    if not tools:
        return out
    if not out or out[0].get("role") != "system":
        out.insert(0, {"role": "system", "content": ""})
    out[0]["tools"] = [{"type": "function", "function": tool_schema(tool)} for tool in tools]
    return out


def thinking_mode(kwargs: Mapping[str, JsonValue]) -> str:
    """"thinking" or "chat", as miles resolves it: `thinking_mode`, else `enable_thinking`, else `thinking`, else
    thinking (the server's default)."""
    if "thinking_mode" in kwargs and kwargs["thinking_mode"] is not None:
        mode = kwargs["thinking_mode"]
    elif kwargs.get("enable_thinking") is not None:
        mode = "thinking" if kwargs["enable_thinking"] else "chat"
    elif kwargs.get("thinking") is not None:
        mode = "thinking" if kwargs["thinking"] else "chat"
    else:
        mode = "thinking"
    if mode not in ("chat", "thinking"):
        raise DeepSeekEncodingError(f"thinking_mode must be 'chat' or 'thinking', got {mode!r}")
    return str(mode)


# --------------------------------------------------------------------------------------------------------------
# V3.2 (miles' vendored encoding_dsv32, drop_thinking=False)
# --------------------------------------------------------------------------------------------------------------
def _v32_message(index: int, messages: Sequence[JsonObject], mode: str) -> str:
    message = messages[index]
    role = message.get("role")
    opener = THINK_START if mode == "thinking" else THINK_END
    if role == "system":
        return _text(message.get("content")) + _sections(message, _V32_TOOLS)
    if role == "developer":
        if not message.get("content"):
            raise DeepSeekEncodingError(f"messages[{index}]: a developer message needs content")
        body = _sections(message, _V32_TOOLS) + f"\n\n# The user's message is: {_text(message.get('content'))}"
        return f"{USER}{body}{ASSISTANT}{opener}"
    if role == "user":
        return f"{USER}{_text(message.get('content'))}{ASSISTANT}{opener}"
    if role == "tool":
        previous = index - 1
        while previous >= 0 and messages[previous].get("role") == "tool":
            previous -= 1
        calls = messages[previous].get("tool_calls") if previous >= 0 else None
        if index != 0 and (previous < 0 or messages[previous].get("role") != "assistant"):
            raise DeepSeekEncodingError(f"messages[{index}]: a tool result must follow an assistant's tool calls")
        order = index - previous
        if not (isinstance(calls, list) and len(calls) >= order):
            raise DeepSeekEncodingError(f"messages[{index}]: a tool result without a tool call")
        out = "\n\n<function_results>" if order == 1 else ""
        out += f"\n<result>{_text(message.get('content'))}</result>"
        if order == len(calls):
            out += f"\n</function_results>\n\n{opener}"
        return out
    if role == "assistant":
        thinking = _text(message.get("reasoning_content")) + THINK_END if mode == "thinking" else ""
        calls = _tool_calls_block(message, "function_calls", lenient=False)
        return f"{thinking}{_text(message.get('content'))}{calls}{EOS}"
    raise DeepSeekEncodingError(f"messages[{index}]: DeepSeek V3.2 has no role {role!r}")


def encode_v32(messages: Sequence[JsonObject], *, mode: str, add_generation_prompt: bool = True) -> str:
    """The V3.2 prompt of `messages` (tools already in the system message: `with_tools`). Without a generation
    prompt, a render ending at a user/developer turn leaves off `<｜Assistant｜>` and the thinking token, one
    ending at tool results the `\\n\\n` and the thinking token (miles' `DeepSeekV32Family`)."""
    prompt = BOS + "".join(_v32_message(i, messages, mode) for i in range(len(messages)))
    if add_generation_prompt or not messages:
        return prompt
    token = THINK_START if mode == "thinking" else THINK_END
    tail = messages[-1].get("role")
    suffix = ASSISTANT + token if tail in ("user", "developer") else "\n\n" + token if tail == "tool" else None
    return prompt[: -len(suffix)] if suffix and prompt.endswith(suffix) else prompt


# --------------------------------------------------------------------------------------------------------------
# V4 (SGLang's encoding_dsv4, drop_thinking=False)
# --------------------------------------------------------------------------------------------------------------
def _fold_tool_results(messages: Sequence[JsonObject]) -> list[JsonObject]:
    """V4 has no tool role: tool results become `<tool_result>` blocks of a user turn, and a user message right
    after them joins that turn (SGLang's `merge_tool_messages`); the results of one assistant's calls are put
    in the order of its calls by `tool_call_id` (`sort_tool_results_by_call_order`)."""
    merged: list[JsonObject] = []
    order: dict[str, int] = {}
    for original in messages:
        message = copy.deepcopy(original)
        role = message.get("role")
        folding = bool(merged) and merged[-1].get("role") == "user" and "blocks" in merged[-1]
        if role == "assistant" and message.get("tool_calls"):
            order = {}
            for position, call in enumerate(message["tool_calls"] or []):
                if isinstance(call, Mapping):
                    function = call.get("function")
                    ident = call.get("id") or (function.get("id") if isinstance(function, Mapping) else "") or ""
                    if ident:
                        order[str(ident)] = position
        if role == "tool":
            block = {"type": "tool_result", "id": _text(message.get("tool_call_id")), "order": dict(order),
                     "content": message.get("content") or ""}
            if folding:
                merged[-1]["blocks"].append(block)
            else:
                merged.append({"role": "user", "blocks": [block]})
        elif role == "user":
            block = {"type": "text", "text": message.get("content") or ""}
            if folding and merged[-1].get("task") is None:
                merged[-1]["blocks"].append(block)
            else:
                merged.append({"role": "user", "content": message.get("content") or "", "blocks": [block],
                               **{key: message[key] for key in ("task", "wo_eos") if key in message}})
        else:
            merged.append(message)
    for message in merged:
        blocks = message.get("blocks")
        results = [block for block in blocks or () if block["type"] == "tool_result"]
        if len(results) > 1 and results[0]["order"]:
            ranked = iter(sorted(results, key=lambda block: block["order"].get(block["id"], 0)))
            message["blocks"] = [next(ranked) if block["type"] == "tool_result" else block for block in blocks]
    return merged


def _v4_user_body(message: JsonObject) -> str:
    blocks = message.get("blocks")
    if not blocks:
        return _text(message.get("content"))
    parts = []
    for block in blocks:
        if block["type"] == "text":
            parts.append(_text(block["text"]))
        else:
            content = block["content"]
            if isinstance(content, list):  # content parts: the text ones, each other kind named
                content = "\n\n".join(_text(part.get("text")) if part.get("type") == "text"
                                      else f"[Unsupported {part.get('type')}]" for part in content)
            parts.append(f"<tool_result>{_text(content)}</tool_result>")
    return "\n\n".join(parts)


def _v4_message(index: int, messages: Sequence[JsonObject], mode: str, effort: str | None) -> str:
    message = messages[index]
    role = message.get("role")
    out = _V4_REASONING_EFFORT_MAX if index == 0 and mode == "thinking" and effort == "max" else ""
    if role == "system":
        out += _text(message.get("content")) + _sections(message, _V4_TOOLS)
    elif role == "developer":
        if not message.get("content"):
            raise DeepSeekEncodingError(f"messages[{index}]: a developer message needs content")
        out += USER + _text(message.get("content")) + _sections(message, _V4_TOOLS)
    elif role == "user":
        out += USER + _v4_user_body(message)
    elif role == "latest_reminder":
        out += LATEST_REMINDER + _text(message.get("content"))
    elif role == "assistant":
        after_task = index > 0 and messages[index - 1].get("task") is not None
        thinking = _text(message.get("reasoning_content")) + THINK_END if mode == "thinking" and not after_task else ""
        calls = _tool_calls_block(message, "tool_calls", lenient=True)
        out += f"{thinking}{_text(message.get('content'))}{calls}" + ("" if message.get("wo_eos") else EOS)
    else:
        raise DeepSeekEncodingError(f"messages[{index}]: DeepSeek V4 has no role {role!r}")
    following = messages[index + 1].get("role") if index + 1 < len(messages) else None
    if following is not None and following not in ("assistant", "latest_reminder"):
        return out
    if message.get("task") is not None:
        raise DeepSeekEncodingError(f"messages[{index}]: V4's internal classification tasks are not served")
    if role in ("user", "developer"):
        out += ASSISTANT + (THINK_START if mode == "thinking" else THINK_END)
    return out


def encode_v4(messages: Sequence[JsonObject], *, mode: str, add_generation_prompt: bool = True,
              reasoning_effort: str | None = None) -> str:
    """The V4 prompt of `messages` (tools already in the system message: `with_tools`). Without a generation
    prompt, a render ending at a user, developer or tool turn leaves off `<｜Assistant｜>` and the thinking
    token (miles' `DeepSeekV4Family`)."""
    if reasoning_effort not in ("max", "high", None):
        raise DeepSeekEncodingError(f"reasoning_effort must be 'max', 'high' or unset, got {reasoning_effort!r}")
    folded = _fold_tool_results(messages)
    prompt = BOS + "".join(_v4_message(i, folded, mode, reasoning_effort) for i in range(len(folded)))
    if add_generation_prompt or not messages:
        return prompt
    suffix = ASSISTANT + (THINK_START if mode == "thinking" else THINK_END)
    if messages[-1].get("role") in ("user", "developer", "tool") and prompt.endswith(suffix):
        return prompt[: -len(suffix)]
    return prompt
