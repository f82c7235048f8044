"""miles' `agentic_tool_call.generate`, ours: one sample = one agent episode through the session server.

Owns the agent contract (`--custom-agent-function-path`): the agent is called with keywords only —
`base_url` (the session's, `http://IP:PORT/sessions/<id>`; OpenAI clients use `base_url + "/v1"`), `prompt`
(the sample's prompt as the data holds it: an OpenAI message list), `request_kwargs` (the rollout's sampling
params under chat names: max_new_tokens→max_tokens, min_new_tokens→min_tokens, sampling_seed→seed, the rest
kept when the chat API has them) and `metadata` (the sample's, plus `max_seq_len` and `session_server_id`).
With `--sglang-api-key`, `api_key` is passed too (the session server asks for it, as the engines do). Its
returned dict is merged into the sample's metadata (a reward left there is the custom reward's to read).

Invariants: the session is deleted on every path; an agent that raises — any exception, `SystemExit`,
`KeyboardInterrupt` or a `CancelledError` of its own included (`coordinator.hooks.calls`) — or that made no model
call, gives an ABORTED sample (logged: a raise as one terminal line and a count, its traceback in the run's log;
generated again), never a sample without tokens — until `--hook-max-failures-in-a-row` episodes in a row failed
so (a call past `--agent-timeout-s` included), which stops the run naming the agent, the count and the last error; a sync agent runs in a worker thread a stop signal
does not wait for; otherwise the sample's tokens, loss mask, rollout logprobs,
status and weight versions are the session's trajectory (`coordinator.sessions.trajectory.assemble_all`): one
sample per leaf of the session's message tree (a sub-agent or a compacted history branches it), each carrying the
episode's metadata (so a reward the agent left there scores every leaf, as slime gives each leaf the episode's
reward), `session_leaves` their count and `session_leaf` its place.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio

from coordinator.hooks.calls import HookBudgetSpent, HookEscaped, call_hook, current_bounds
from coordinator.hooks.runtime import GenerateFnInput, GenerateFnOutput, HookError, current_call
from coordinator.lifecycle.failures import ContainedFailures
from coordinator.sessions.images import agent_messages, decode_urls
from coordinator.sessions.trajectory import assemble_all
from replay.sample import Sample, SampleStatus
from workers.boundary.json_input import JsonObject
from workers.hook_loading import load_object

if TYPE_CHECKING:
    from coordinator.sessions.server import SessionServer

log = logging.getLogger(__name__)
#: the agent's failures: one line and a count on the terminal, each traceback in the run's log
AGENT_FAILURES = ContainedFailures(log)

FLAG = "--custom-agent-function-path"
_RENAMED = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "sampling_seed": "seed"}
#: The sampling fields of SGLang's ChatCompletionRequest an agent's request may carry.
_CHAT_FIELDS = frozenset({
    "max_tokens", "min_tokens", "seed", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids",
    "stop_regex", "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias", "n", "ignore_eos",
    "skip_special_tokens", "no_stop_trim", "custom_params", "regex", "ebnf", "logprobs", "top_logprobs",
})


def build_chat_request_kwargs(sampling_params: JsonObject) -> JsonObject:
    """The rollout's sampling params as a chat request's fields (miles' build_chat_request_kwargs)."""
    kwargs = dict(sampling_params)
    for ours, theirs in _RENAMED.items():
        if ours in kwargs:
            value = kwargs.pop(ours)
            kwargs.setdefault(theirs, value)
    return {key: value for key, value in kwargs.items() if key in _CHAT_FIELDS and value is not None}


def check_agent_hook(flag: str, path: str, target: object) -> str:
    """Start-up check of the agent (keywords base_url, prompt, request_kwargs, metadata) or of a message
    matcher (two positional messages); ConfigError naming the flag otherwise."""
    from coordinator.config.fields import ConfigError

    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return "called as given (no signature to check)"
    if flag == FLAG:
        try:
            signature.bind(base_url="", prompt=[], request_kwargs={}, metadata={})
        except TypeError as error:
            raise ConfigError(f"{flag} {path!r} cannot be called as miles calls an agent, "
                              f"await fn(*, base_url, prompt, request_kwargs, metadata): {error}") from None
        return "called as await fn(base_url=..., prompt=..., request_kwargs=..., metadata=...)"
    try:
        signature.bind({}, {})
    except TypeError as error:
        raise ConfigError(f"{flag} {path!r} cannot be called as fn(stored_message, new_message) -> bool: "
                          f"{error}") from None
    return "called as fn(stored_message, new_message) -> bool"


def _sessions(args: argparse.Namespace) -> SessionServer:
    runtime = getattr(args, "_rayless_runtime", None)
    sessions = getattr(runtime, "sessions", None)
    if sessions is None:
        raise HookError("agentic_tool_call.generate requires the session server: pass --use-session-server")
    return sessions


def _aborted(sample: Sample) -> Sample:
    sample.status = SampleStatus.ABORTED
    sample.tokens, sample.response_length, sample.response = [], 0, ""
    sample.loss_mask, sample.rollout_log_probs = [], []
    return sample


async def _run_agent(agent: Callable[..., object], what: str, **kwargs: object) -> object:
    # a sync agent runs in a worker thread a stop abandons; its exit, interrupt or own CancelledError comes out
    # as HookEscaped (an Exception), never as a cancellation that would end this task as if it had finished
    # counted=False: whether the episode is usable (a model call recorded) is judged by `generate` after it
    return await call_hook(agent, what=what, kind="agent", counted=False, **kwargs)


async def generate(input: GenerateFnInput) -> GenerateFnOutput:
    args, sample = input.args, input.sample
    server = _sessions(args)
    agent = load_object(args.custom_agent_function_path, what=FLAG)
    call = current_call()
    route = args._rayless_runtime.routes.get(call.route_token) if call is not None else None
    session = await server.create(engine=route.group.engine if route is not None else None)
    base_url = f"{server.url}/sessions/{session.id}"
    metadata = {**(sample.metadata or {}), "session_server_id": f"{server.host}:{server.port}"}
    if args.max_seq_len is not None:
        metadata["max_seq_len"] = args.max_seq_len
    failed = False
    returned: Any = None
    what = f"{FLAG} {args.custom_agent_function_path!r}"
    bounds = current_bounds()
    try:
        # The engines' key (--sglang-api-key) goes to the agent only to reach this run's session server.
        key = {"api_key": server.api_key} if server.api_key else {}
        # a VLM sample's images reach the agent as OpenAI image_url parts of its prompt (docs/vlm.md)
        prompt = agent_messages(sample.prompt, (sample.multimodal_inputs or {}).get("images") or [])
        returned = await _run_agent(agent, what, base_url=base_url, prompt=prompt,
                                    request_kwargs=build_chat_request_kwargs(input.sampling_params),
                                    metadata=metadata, **key)
    except HookBudgetSpent:
        raise  # the failure budget is spent: the run stops
    except Exception as error:  # the agent's failure costs this sample, not the run
        AGENT_FAILURES.report(f"{FLAG} {args.custom_agent_function_path}",
                              f"sample {sample.group_index}/{sample.sample_index}", error)
        failed = True
        if not isinstance(error, HookEscaped):  # an escape or a timeout was counted by call_hook already
            bounds.failed("agent", what, error)
    finally:
        await server.delete(session.id)
    assembled = [] if failed else assemble_all(session, max_seq_len=args.max_seq_len)
    if not assembled:
        if not failed:
            log.warning("agent session %s of sample %s/%s recorded no usable model call", session.id,
                        sample.group_index, sample.sample_index)
            bounds.failed("agent", what, "its episode made no model call")
        return GenerateFnOutput(samples=_aborted(sample))
    bounds.returned("agent")
    if returned is not None and not isinstance(returned, dict):
        raise HookError(f"{FLAG} {args.custom_agent_function_path!r} returned {type(returned).__name__}; "
                        "expected a dict (merged into the sample's metadata) or None")
    tokenizer = server.tito.tokenizer
    metadata = {**(sample.metadata or {}), **(returned or {}), "session_leaves": len(assembled)}
    samples = []
    for one in assembled:  # a branching episode gives one sample per leaf, each with the episode's metadata
        out = sample if not samples else dataclasses.replace(sample)
        out.tokens = one.tokens
        out.response_length = one.response_length
        out.loss_mask = one.loss_mask
        out.rollout_log_probs = one.rollout_log_probs
        out.status = one.status
        out.weight_versions = one.weight_versions
        out.response = tokenizer.decode(one.tokens[len(one.tokens) - one.response_length:])
        out.metadata = {**metadata, "session_turns": one.turns, "session_leaf": one.leaf}
        # the images the leaf's last request held: `settle_hook_images` makes the trainer's inputs from them
        images = await anyio.to_thread.run_sync(decode_urls, one.images) if one.images else []
        out.multimodal_inputs = {"images": images} if images else None
        out.multimodal_train_inputs = None
        samples.append(out)
    return GenerateFnOutput(samples=samples[0] if len(samples) == 1 else samples)
