"""The session server in front of two real CPU engines, driven by the `openai` SDK and plain HTTP.

A session's calls all land on its engine (two sessions on two engines), its first prompt is the chat template's
and each later one the stored ids plus only the appended messages; streamed answers are the recorded ones;
a request that rewrites history is a new branch of the session's tree, and the samples are one per leaf; the
official `anthropic` and `openai` SDKs on the session's /v1/messages and /v1/responses, whole and streamed, record
the engine's exact tokens and logprobs; other paths are proxied; the API key, unknown
sessions and oversized bodies get 401 / 404 / 413; `/samples` gives the trajectory's fields; when a session's
engine dies its next call is served by the other engine and the trajectory goes on; with a router, sessions
still go straight to the engines; the agentic generate merges the agent's dict into the metadata and turns an
agent's exception into an aborted sample; an agent that hangs (async or sync) is ended at its limit, one that
never calls the model is a failed episode too, and failures in a row spend the budget that stops the run.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import time
from pathlib import Path
from typing import Any

import anthropic
import anyio
import httpx
import openai
import pytest
from transformers import AutoTokenizer

from coordinator.engines.client import EngineClient
from coordinator.engines.fleet import EngineFleet
from coordinator.engines.spec import EngineLaunchSpec
from coordinator.hooks.calls import HookBounds, HookBudgetSpent, hook_bounds
from coordinator.hooks.runtime import GenerateFnInput, HookRoutes
from coordinator.rollout.dispatch import Dispatcher
from coordinator.sessions.agentic import generate
from coordinator.sessions.server import SessionServer
from coordinator.sessions.tito import resolve_matcher, tito_tokenizer
from replay.sample import Sample, SampleStatus
from tests.support import session_agent
from tests.support.sockets import first_reply
from workers.boundary.engine_routes import agent_may_call
from workers.engine.control_routes import ControlRoutes
from workers.engine.generate_routes import GenerateRoutes
from workers.engine.info_routes import InfoRoutes
from workers.engine.memory_routes import MemoryRoutes
from workers.engine.openai_routes import OpenAIRoutes
from workers.engine.weight_routes import WeightRoutes

KEY = "session-server-key-0b7"
ADMIN = "coordinator-admin-key-5c1"  # the engines' --admin-api-key: the coordinator's client alone holds it
ENV = (("OMP_NUM_THREADS", "1"), ("MKL_NUM_THREADS", "1"))
AUTH = {"Authorization": f"Bearer {KEY}"}
ASK = [{"role": "user", "content": "1+2"}]
#: a request declaring a 2 GB body, headers only: answered 413 before a byte of it is read
DECLARED_2GB = (b"POST /sessions/x/v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                + b"\r\nContent-Type: application/json\r\nContent-Length: 2147483648\r\n\r\n")


async def _chat(client: openai.AsyncOpenAI, messages: list[dict[str, Any]], **extra: Any) -> Any:
    return await client.chat.completions.create(model="m", messages=messages, max_tokens=4,
                                                extra_body={"ignore_eos": True}, **extra)


async def test_sessions_are_token_in_token_out_and_sticky(tiny_model_dir: Path, tmp_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    spec = EngineLaunchSpec(kind="rayless", model_path=str(tiny_model_dir), env=ENV, start_timeout=120.0, api_key=KEY,
                            admin_api_key=ADMIN)
    async with EngineClient(max_connections=32, api_key=KEY, admin_api_key=ADMIN) as client, \
            anyio.create_task_group() as tg:
        fleet = EngineFleet(client=client, launch=spec, num_engines=2, run_dir=tmp_path)
        await tg.start(fleet.run)
        for handle in fleet.engines:  # each engine answers with its own name as its weight version (admin key)
            await client.engine(handle.url).update_weight_version(handle.name)
        server = SessionServer(dispatcher=Dispatcher(client=client, pool=fleet),
                               tito=tito_tokenizer("default", tokenizer), matcher=resolve_matcher("strict"),
                               api_key=KEY, max_body_bytes=65536, max_message_bytes=4096)
        await tg.start(server.run)
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as http:
            ids = [(await http.post("/sessions")).json()["session_id"] for _ in range(2)]
            agents = [openai.AsyncOpenAI(base_url=f"{server.url}/sessions/{i}/v1", api_key=KEY, max_retries=0)
                      for i in ids]
            # Two turns in each session, a tool message between them.
            served: list[set[str]] = [set(), set()]
            for index, agent in enumerate(agents):
                first = await _chat(agent, ASK)
                history = [*ASK, {"role": "assistant", "content": first.choices[0].message.content},
                           {"role": "tool", "content": "3"}]
                second = await _chat(agent, history)
                served[index] |= {r.choices[0].model_extra["meta_info"]["weight_version"] for r in (first, second)}
            assert all(len(names) == 1 for names in served) and served[0] != served[1], served

            records = (await http.get(f"/sessions/{ids[0]}")).json()["records"]
            turn1, turn2 = (r["request"]["input_ids"] for r in records)
            out1 = [p[1] for p in records[0]["response"]["choices"][0]["meta_info"]["output_token_logprobs"]]
            rendered = tokenizer.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True)
            assert turn1 == tokenizer.encode(rendered, add_special_tokens=False)
            appended = tokenizer.encode("<|im_start|>tool\n3<|im_end|>\n<|im_start|>assistant\n",
                                        add_special_tokens=False)
            assert turn2 == turn1 + out1 + appended  # the generated ids kept as they were, no retokenisation

            # Streaming: the agent gets the answer as SSE; the trajectory records it like any other turn.
            history = [*ASK, {"role": "assistant", "content": first.choices[0].message.content},
                       {"role": "tool", "content": "3"},
                       {"role": "assistant", "content": second.choices[0].message.content},
                       {"role": "user", "content": "again"}]
            text = "".join([c.choices[0].delta.content or "" async for c in await _chat(agents[1], history, stream=True)])
            third = (await http.get(f"/sessions/{ids[1]}")).json()["records"][-1]["response"]
            assert text == third["choices"][0]["message"]["content"]

            # Rewritten history (a compaction, a client's edit): a new branch of the session's tree, its prompt the
            # template over its messages.
            rewritten = [ASK[0], {"role": "assistant", "content": "not what it said"}, {"role": "user", "content": "x"}]
            await _chat(agents[1], rewritten)
            branched = (await http.get(f"/sessions/{ids[1]}")).json()["records"]
            assert len(branched) == 4 and branched[3]["request"]["input_ids"] == tokenizer.encode(
                tokenizer.apply_chat_template(rewritten, tokenize=False, add_generation_prompt=True),
                add_special_tokens=False)

            # The trajectory as samples, one per leaf. The first turn ended by length (max_tokens=4, ignore_eos),
            # which ends that branch's trajectory (miles' rule): its sample is that turn alone, truncated; the
            # rewritten branch is a sample of its own.
            samples = (await http.post(f"/sessions/{ids[1]}/samples", json={})).json()["samples"]
            assert len(samples) == 2
            assert samples[0]["loss_mask"] == [1, 1, 1, 1] and samples[0]["response_length"] == 4
            assert samples[0]["status"] == "truncated" and samples[0]["turns"] == 1
            out4 = [p[1] for p in branched[3]["response"]["choices"][0]["meta_info"]["output_token_logprobs"]]
            assert samples[1]["tokens"] == branched[3]["request"]["input_ids"] + out4
            assert samples[1]["loss_mask"] == [1] * len(out4)

            models = await agents[0].models.list()  # proxied to the session's engine
            assert models.data[0].id == str(tiny_model_dir)
            assert (await http.get(f"/sessions/{ids[0]}", headers={"Authorization": "Bearer nope"})).status_code == 401
            # Anthropic's `x-api-key` opens only a session's Messages routes, and only with the key
            anthropic_key = {"Authorization": "", "x-api-key": KEY}
            assert (await http.get(f"/sessions/{ids[0]}", headers=anthropic_key)).status_code == 401
            assert (await http.post(f"/sessions/{ids[0]}/v1/chat/completions", json={},
                                    headers=anthropic_key)).status_code == 401
            assert (await http.post(f"/sessions/{ids[0]}/v1/messages", json={},
                                    headers={"Authorization": "", "x-api-key": "nope"})).status_code == 401
            assert (await http.get("/sessions/nope")).status_code == 404
            big = await http.post(f"/sessions/{ids[0]}/v1/chat/completions", content=b"x" * 70000)
            assert big.status_code == 413
            long = await http.post(f"/sessions/{ids[0]}/v1/chat/completions",
                                   json={"messages": [{"role": "user", "content": "y" * 5000}]})
            assert long.status_code == 413 and "messages[0]" in long.json()["error"]["message"]
            # Hostile bodies on the structured formats: the formats' own 400s naming the field, the shared 413.
            for path, body, words in (
                ("v1/messages", {"messages": "x"}, "'messages'"),
                ("v1/messages", {"model": "m", "max_tokens": 0, "messages": ASK}, "max_tokens"),
                ("v1/messages", {"model": "m", "max_tokens": 2, "messages": [*ASK, {"role": "assistant",
                                                                                    "content": "3"}]}, "prefill"),
                ("v1/messages", {"model": "m", "max_tokens": 2, "messages": [
                    {"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
                ("v1/responses", {"input": 5}, "'input'"),
                ("v1/responses", {"input": "x", "previous_response_id": "r"}, "previous_response_id"),
            ):
                answer = await http.post(f"/sessions/{ids[0]}/{path}", json=body)
                assert answer.status_code == 400 and words in answer.json()["error"]["message"], (path, answer.text)
            huge = await http.post(f"/sessions/{ids[0]}/v1/messages", json={
                "model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "y" * 5000}]})
            assert huge.status_code == 413 and "messages[0]" in huge.json()["error"]["message"]
            host, port = server.host, server.port
            declared = await anyio.to_thread.run_sync(lambda: first_reply(host, port, DECLARED_2GB, timeout=10))
            assert declared.startswith(b"HTTP/1.1 413"), declared[:200]
            for own in ({"chat_template": "{{ 'x' }}"}, {"chat_template_kwargs": {"chat_template": "{{ 'x' }}"}}):
                refused = await http.post(f"/sessions/{ids[0]}/v1/chat/completions", json={"messages": ASK, **own})
                assert refused.status_code == 400 and "chat template" in refused.json()["error"]["message"]
            await _drill(http, fleet, tiny_model_dir)
            await _structured_formats(server, http)

            # The engine of session 0 dies: its next call is served by the other engine, the trajectory goes on.
            dead = next(h for h in fleet.engines if h.name in served[0])
            assert dead.process is not None and dead.process.pid is not None
            os.killpg(dead.process.pid, signal.SIGKILL)
            moved = await _chat(agents[0], _continue(records))
            assert moved.choices[0].model_extra["meta_info"]["weight_version"] in served[1]
            assert len((await http.get(f"/sessions/{ids[0]}")).json()["records"]) == 3

            assert (await http.delete(f"/sessions/{ids[0]}")).status_code == 200
            assert (await http.get(f"/sessions/{ids[0]}")).status_code == 404
            for agent in agents:
                await agent.close()

        # With a router, sessions still go straight to the engines (sglang-router drops input_ids and
        # return_meta_info): nothing listens at this router address, and the chat is served.
        routed = SessionServer(dispatcher=Dispatcher(client=client, pool=fleet, router_url="http://127.0.0.1:9"),
                               tito=tito_tokenizer("default", tokenizer), matcher=resolve_matcher("strict"),
                               api_key=KEY)
        await tg.start(routed.run)
        session = await routed.create()
        async with openai.AsyncOpenAI(base_url=f"{routed.url}/sessions/{session.id}/v1", api_key=KEY,
                                      max_retries=0) as agent:
            reply = await _chat(agent, ASK)
        assert reply.choices[0].model_extra["meta_info"]["weight_version"] in served[1]
        assert routed.sessions[session.id].turns[0].prompt_len == len(turn1)
        await routed.delete(session.id)

        # miles' agentic generate over it: the agent's dict lands in the metadata; an agent that raises — an
        # exception, its own CancelledError, a sync agent's SystemExit — gives an aborted sample (generated again,
        # never trained without tokens); either way its session is gone afterwards.
        runtime = argparse.Namespace(sessions=routed, routes=HookRoutes())
        episode_s: dict[str, float] = {}  # how long each episode took here: the limit below is derived from it
        for agent_path, status in (("run_agent", SampleStatus.COMPLETED), ("failing_agent", SampleStatus.ABORTED),
                                   ("cancelling_agent", SampleStatus.ABORTED),
                                   ("exiting_agent", SampleStatus.ABORTED)):
            args = argparse.Namespace(custom_agent_function_path=f"tests.support.session_agent.{agent_path}",
                                      max_seq_len=None, _rayless_runtime=runtime)
            sample = Sample(prompt=ASK, metadata={"task": "sum"})
            # Every token a stop token: each turn ends by `stop` after one token, so the agent makes both turns.
            params = {"max_new_tokens": 3, "stop_token_ids": list(range(len(tokenizer))), "skip_special_tokens": False}
            started = time.monotonic()
            out = (await generate(GenerateFnInput(state=None, sample=sample, sampling_params=params,
                                                  evaluation=False, args=args))).samples
            episode_s[agent_path] = time.monotonic() - started
            assert out.status is status and not routed.sessions
            if status is SampleStatus.ABORTED:
                assert out.tokens == [] and out.response_length == 0
            else:
                assert out.metadata["task"] == "sum" and out.metadata["tool_output"] == "3"
                assert out.loss_mask[0] == 1 and out.loss_mask[-1] == 1 and sum(out.loss_mask) == 2
                assert out.metadata["session_turns"] == 2

        # Agents whose conversation branches (examples/harness_agents/branching_agents.py): a sub-agent in the same
        # session, a compacted history; one sample per leaf, each masking exactly its own generated tokens.
        for agent_path, leaves in (("with_sub_agent", [2, 1]), ("compacting", [2, 2])):
            args = argparse.Namespace(
                custom_agent_function_path=f"examples.harness_agents.branching_agents.{agent_path}",
                max_seq_len=None, _rayless_runtime=runtime)
            out = (await generate(GenerateFnInput(state=None, sample=Sample(prompt=ASK), sampling_params=params,
                                                  evaluation=False, args=args))).samples
            assert isinstance(out, list) and [s.metadata["session_turns"] for s in out] == leaves, agent_path
            assert [sum(s.loss_mask) for s in out] == leaves  # one generated token a turn (every token stops)
            assert all(s.metadata["session_leaves"] == 2 and s.status is SampleStatus.COMPLETED for s in out)
            assert [s.metadata["session_leaf"] for s in out] == [0, 1] and not routed.sessions

        # A session a generate function opened and never closed is reaped at the end of a rollout it idled
        # through; one called since the rollout began is left.
        left, busy = await routed.create(), await routed.create()
        began = time.monotonic()
        routed.get(busy.id)
        assert await routed.reap(began) == 1 and list(routed.sessions) == [busy.id]
        await routed.delete(busy.id)
        assert left.closed

        # Bounded (docs/hooks.md#bounds-on-user-code): an agent that hangs (async, or sync in its thread) is
        # ended at --agent-timeout-s, one that never calls the model gives nothing to train on; each is a failed
        # episode (aborted, generated again) and counts towards --hook-max-failures-in-a-row, which a success
        # starts over; the budget spent, HookBudgetSpent stops the run naming the agent, the count, its last error.
        # The limit: a whole episode of run_agent (two turns) as this machine ran it just now, four times over,
        # and at least 1 s; a fixed 1 s was a deadline a loaded machine could make run_agent miss.
        limit = float(max(1, math.ceil(4 * episode_s["run_agent"])))
        bounds = HookBounds(limits={"agent": limit}, max_in_a_row=5)
        with hook_bounds(bounds):
            def agentic_args(name: str) -> argparse.Namespace:
                return argparse.Namespace(custom_agent_function_path=f"tests.support.session_agent.{name}",
                                          max_seq_len=None, _rayless_runtime=runtime)

            async def episode(name: str) -> Sample:
                return (await generate(GenerateFnInput(state=None, sample=Sample(prompt=ASK), sampling_params=params,
                                                       evaluation=False, args=agentic_args(name)))).samples

            try:
                for count, name in enumerate(("hanging_agent", "blocking_agent", "silent_agent", "failing_agent"), 1):
                    with anyio.fail_after(limit + 30):  # far past the limit: the limit, not this, ends a hang
                        out = await episode(name)
                    assert out.status is SampleStatus.ABORTED and out.tokens == [] and not routed.sessions, name
                    assert bounds.in_a_row["agent"] == count, name
                assert (await episode("run_agent")).status is SampleStatus.COMPLETED
                assert bounds.in_a_row["agent"] == 0  # a usable episode starts the count over
                for _ in range(4):
                    await episode("silent_agent")
                with pytest.raises(HookBudgetSpent, match=r"--custom-agent-function-path 'tests\.support\."
                                   r"session_agent\.hanging_agent' failed 5 times in a row .*last: .*did not "
                                   rf"return within {limit:g} s \(--agent-timeout-s\)"):
                    await episode("hanging_agent")
                assert not routed.sessions
            finally:
                session_agent.RELEASE.set()
        tg.cancel_scope.cancel()


#: a body per route for the drill: what a hostile agent would send (the base model's weights, a new version...)
def _drill_bodies(model_dir: Path) -> dict[str, Any]:
    return {
        "/generate": {"text": "1+2=", "sampling_params": {"max_new_tokens": 3, "temperature": 0}},
        "/v1/chat/completions": {"model": "m", "messages": ASK, "max_tokens": 2},
        "/v1/completions": {"model": "m", "prompt": "1+2=", "max_tokens": 2},
        "/update_weights_from_disk": {"model_path": str(model_dir)},
        "/update_weight_version": {"new_version": "hijacked"},
        "/pause_generation": {"mode": "abort"},
        "/release_memory_occupation": {},
        "/abort_request": {"abort_all": True},
        "/init_weights_update_group": {"master_address": "127.0.0.1", "master_port": 9, "rank_offset": 1,
                                       "world_size": 2, "group_name": "g", "backend": "gloo"},
    }


def _engine_routes() -> list[tuple[str, str]]:
    """Every (method, path) of our engine, from its route modules (none is constructed with an engine)."""
    modules = (ControlRoutes, GenerateRoutes, InfoRoutes, MemoryRoutes, WeightRoutes, OpenAIRoutes)
    return [(method, route.path) for module in modules for route in module(None).routes()  # type: ignore[arg-type]
            for method in sorted(route.methods - {"HEAD"})]


async def _drill(http: httpx.AsyncClient, fleet: EngineFleet, model_dir: Path) -> None:
    """A drill agent in its own session calls every route of the engine through it: the generation and read
    routes answer, every other one is a 403 that reaches no engine; the engines' weights, weight versions and
    greedy generation are what they were. The engines themselves ask for the admin key on control routes."""
    session = (await http.post("/sessions")).json()["session_id"]
    bodies = _drill_bodies(model_dir)
    probe = {**bodies["/generate"], "return_logprob": True}
    version = (await http.get(f"/sessions/{session}/get_weight_version")).json()["weight_version"]
    before = (await http.post(f"/sessions/{session}/generate", json=probe)).json()
    answered = []
    for method, path in _engine_routes():
        body = bodies.get(path, {}) if method != "GET" else None
        answer = await http.request(method, f"/sessions/{session}{path}", json=body)
        if agent_may_call(path, method):
            assert answer.status_code == 200, (method, path, answer.text[:300])
            answered.append(path)
        else:
            assert answer.status_code == 403, (method, path, answer.status_code, answer.text[:300])
            assert "control routes are the coordinator's" in answer.json()["error"]["message"]
    assert {"/generate", "/v1/chat/completions", "/v1/completions", "/v1/models", "/model_info"} <= set(answered)
    after = (await http.post(f"/sessions/{session}/generate", json=probe)).json()
    assert after["output_ids"] == before["output_ids"]
    assert after["meta_info"]["output_token_logprobs"] == before["meta_info"]["output_token_logprobs"]
    assert after["meta_info"]["weight_version"] == before["meta_info"]["weight_version"] == version
    assert (await http.get(f"/sessions/{session}/get_weight_version")).json()["weight_version"] == version
    assert (await http.delete(f"/sessions/{session}")).status_code == 200
    # The engines: the agents' key opens generation, not control; the admin key opens control, not generation.
    engine = fleet.engines[0].url
    async with httpx.AsyncClient(base_url=engine, timeout=30) as direct:
        assert (await direct.post("/pause_generation", json={}, headers=AUTH)).status_code == 401
        assert (await direct.get("/server_info", headers=AUTH)).status_code == 401
        info = await direct.get("/server_info", headers={"Authorization": f"Bearer {ADMIN}"})
        assert info.status_code == 200 and ADMIN not in info.text and KEY not in info.text
        assert (await direct.post("/generate", json=probe, headers=AUTH)).status_code == 200
        assert (await direct.post("/generate", json=probe,
                                  headers={"Authorization": f"Bearer {ADMIN}"})).status_code == 401


async def _greedy_turns_are_the_engines(http: httpx.AsyncClient, session: str) -> list[dict[str, Any]]:
    """Each recorded turn of a greedy session: its output ids and logprobs are what the session's engine generates
    for the recorded prompt ids (SGLang's /generate, through the session's proxy)."""
    records = (await http.get(f"/sessions/{session}")).json()["records"]
    for record in records:
        pairs = record["response"]["choices"][0]["meta_info"]["output_token_logprobs"]
        again = (await http.post(f"/sessions/{session}/generate", json={
            "input_ids": record["request"]["input_ids"], "return_logprob": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": record["request"]["max_tokens"]}})).json()
        assert again["output_ids"] == [p[1] for p in pairs]
        assert all(abs(a[0] - b[0]) <= 1e-6 for a, b in zip(again["meta_info"]["output_token_logprobs"], pairs,
                                                            strict=True))
    return records


async def _structured_formats(server: SessionServer, http: httpx.AsyncClient) -> None:
    """The official `anthropic` SDK on /v1/messages and `openai` on /v1/responses, each in its own session, whole
    then streamed with the history sent back: each turn recorded with the engine's own tokens and logprobs, the
    second prompt the first turn's exact ids plus only the new messages (the reply stored as the client sends it
    back), the stream's text the recorded answer's."""
    tools = [{"name": "add", "description": "adds", "input_schema": {"type": "object",
                                                                      "properties": {"a": {"type": "number"}}}}]
    sid = (await http.post("/sessions")).json()["session_id"]
    async with anthropic.AsyncAnthropic(base_url=f"{server.url}/sessions/{sid}", api_key=KEY,
                                        max_retries=0) as claude:  # the SDK's `x-api-key` header
        ask: list[Any] = [{"role": "user", "content": "1+2"}]
        # (this SDK dropped `temperature` from its signature; SGLang's Messages route still reads it)
        first = await claude.messages.create(model="m", max_tokens=3, system="be brief", messages=ask, tools=tools,
                                             extra_body={"temperature": 0.0, "return_meta_info": True})
        assert first.stop_reason in ("max_tokens", "end_turn") and first.usage.output_tokens >= 1
        history = [*ask, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "3"}]}]
        async with claude.messages.stream(model="m", max_tokens=3, system="be brief", messages=history,
                                          tools=tools, extra_body={"temperature": 0.0}) as stream:
            streamed = await stream.get_final_message()
    records = await _greedy_turns_are_the_engines(http, sid)
    (p1, p2) = (r["request"]["input_ids"] for r in records)
    out1 = [p[1] for p in records[0]["response"]["choices"][0]["meta_info"]["output_token_logprobs"]]
    assert p2[:len(p1) + len(out1)] == p1 + out1 and len(records[0]["request"]["tools"]) == 1
    assert first.model_extra["meta_info"]["output_token_logprobs"] == \
        records[0]["response"]["choices"][0]["meta_info"]["output_token_logprobs"]
    assert "".join(b.text for b in streamed.content if b.type == "text") == \
        records[1]["response"]["choices"][0]["message"]["content"]

    sid = (await http.post("/sessions")).json()["session_id"]
    async with openai.AsyncOpenAI(base_url=f"{server.url}/sessions/{sid}/v1", api_key=KEY, max_retries=0) as gpt:
        whole = await gpt.responses.create(model="m", input="1+2", instructions="be brief", max_output_tokens=3,
                                           temperature=0.0)
        items = [{"role": "user", "content": "1+2"}, *[item.model_dump(exclude_none=True) for item in whole.output],
                 {"role": "user", "content": "more"}]
        events = [event async for event in await gpt.responses.create(
            model="m", input=items, instructions="be brief", max_output_tokens=3, temperature=0.0, stream=True)]
    assert events[-1].type in ("response.completed", "response.incomplete")
    records = await _greedy_turns_are_the_engines(http, sid)
    (p1, p2) = (r["request"]["input_ids"] for r in records)
    out1 = [p[1] for p in records[0]["response"]["choices"][0]["meta_info"]["output_token_logprobs"]]
    assert p2[:len(p1) + len(out1)] == p1 + out1
    assert whole.output_text == records[0]["response"]["choices"][0]["message"]["content"]
    assert events[-1].response.output_text == records[1]["response"]["choices"][0]["message"]["content"]
    samples = (await http.post(f"/sessions/{sid}/samples", json={})).json()["samples"]
    assert len(samples) == 1 and samples[0]["tokens"][:len(p1)] == p1


def _continue(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages that continue a session after its recorded turns: the last request, the reply, a user turn."""
    last = records[-1]
    return [*last["request"]["messages"], last["response"]["choices"][0]["message"],
            {"role": "user", "content": "more"}]
