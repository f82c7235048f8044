"""The session server in front of two real CPU engines, driven by the `openai` SDK and plain HTTP.

A session's calls all land on its engine (two sessions on two engines), its first prompt is the chat template's
and each later one the stored ids plus only the appended messages; streamed answers are the recorded ones;
a request that rewrites history is a 400 and is not recorded; other paths are proxied; the API key, unknown
sessions and oversized bodies get 401 / 404 / 413; `/samples` gives the trajectory's fields; when a session's
engine dies its next call is served by the other engine and the trajectory goes on; with a router, sessions
still go straight to the engines; the agentic generate merges the agent's dict into the metadata and turns an
agent's exception into an aborted sample; an agent that hangs (async or sync) is ended at its limit, one that
never calls the model is a failed episode too, and failures in a row spend the budget that stops the run.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path
from typing import Any

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

KEY = "session-server-key-0b7"
ENV = (("OMP_NUM_THREADS", "1"), ("MKL_NUM_THREADS", "1"))
AUTH = {"Authorization": f"Bearer {KEY}"}
ASK = [{"role": "user", "content": "1+2"}]


async def _chat(client: openai.AsyncOpenAI, messages: list[dict[str, Any]], **extra: Any) -> Any:
    return await client.chat.completions.create(model="m", messages=messages, max_tokens=4,
                                                extra_body={"ignore_eos": True}, **extra)


async def test_sessions_are_token_in_token_out_and_sticky(tiny_model_dir: Path, tmp_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    spec = EngineLaunchSpec(kind="rayless", model_path=str(tiny_model_dir), env=ENV, start_timeout=120.0, api_key=KEY)
    async with EngineClient(max_connections=32, api_key=KEY) as client, anyio.create_task_group() as tg:
        fleet = EngineFleet(client=client, launch=spec, num_engines=2, run_dir=tmp_path)
        await tg.start(fleet.run)
        for handle in fleet.engines:  # each engine answers with its own name as its weight version
            await client.engine(handle.url).update_weight_version(handle.name)
        server = SessionServer(dispatcher=Dispatcher(client=client, pool=fleet),
                               tito=tito_tokenizer("default", tokenizer), matcher=resolve_matcher("strict"),
                               api_key=KEY, max_body_bytes=65536)
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

            # Rewriting history: 400, not recorded.
            try:
                await _chat(agents[1], [ASK[0], {"role": "assistant", "content": "not what it said"},
                                        {"role": "user", "content": "x"}])
                raise AssertionError("a rewritten history was accepted")
            except openai.BadRequestError as error:
                assert "do not continue the session" in str(error)
            assert len((await http.get(f"/sessions/{ids[1]}")).json()["records"]) == 3

            # The trajectory as a sample: its first turn ended by length (max_tokens=4, ignore_eos), which ends
            # the trajectory (miles' rule): the sample is that turn alone, truncated.
            sample = (await http.post(f"/sessions/{ids[1]}/samples", json={})).json()["samples"][0]
            assert sample["loss_mask"] == [1, 1, 1, 1] and sample["response_length"] == 4
            assert sample["status"] == "truncated" and sample["turns"] == 1

            models = await agents[0].models.list()  # proxied to the session's engine
            assert models.data[0].id == str(tiny_model_dir)
            assert (await http.get(f"/sessions/{ids[0]}", headers={"Authorization": "Bearer nope"})).status_code == 401
            assert (await http.get("/sessions/nope")).status_code == 404
            big = await http.post(f"/sessions/{ids[0]}/v1/chat/completions", content=b"x" * 70000)
            assert big.status_code == 413

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
        for agent_path, status in (("run_agent", SampleStatus.COMPLETED), ("failing_agent", SampleStatus.ABORTED),
                                   ("cancelling_agent", SampleStatus.ABORTED),
                                   ("exiting_agent", SampleStatus.ABORTED)):
            args = argparse.Namespace(custom_agent_function_path=f"tests.support.session_agent.{agent_path}",
                                      max_seq_len=None, _rayless_runtime=runtime)
            sample = Sample(prompt=ASK, metadata={"task": "sum"})
            # Every token a stop token: each turn ends by `stop` after one token, so the agent makes both turns.
            params = {"max_new_tokens": 3, "stop_token_ids": list(range(len(tokenizer))), "skip_special_tokens": False}
            out = (await generate(GenerateFnInput(state=None, sample=sample, sampling_params=params,
                                                  evaluation=False, args=args))).samples
            assert out.status is status and not routed.sessions
            if status is SampleStatus.ABORTED:
                assert out.tokens == [] and out.response_length == 0
            else:
                assert out.metadata["task"] == "sum" and out.metadata["tool_output"] == "3"
                assert out.loss_mask[0] == 1 and out.loss_mask[-1] == 1 and sum(out.loss_mask) == 2
                assert out.metadata["session_turns"] == 2

        # Bounded (docs/hooks.md#bounds-on-user-code): an agent that hangs (async, or sync in its thread) is
        # ended at --agent-timeout-s, one that never calls the model gives nothing to train on; each is a failed
        # episode (aborted, generated again) and counts towards --hook-max-failures-in-a-row, which a success
        # starts over; the budget spent, HookBudgetSpent stops the run naming the agent, the count, its last error.
        bounds = HookBounds(limits={"agent": 1.0}, max_in_a_row=5)
        with hook_bounds(bounds):
            def agentic_args(name: str) -> argparse.Namespace:
                return argparse.Namespace(custom_agent_function_path=f"tests.support.session_agent.{name}",
                                          max_seq_len=None, _rayless_runtime=runtime)

            async def episode(name: str) -> Sample:
                return (await generate(GenerateFnInput(state=None, sample=Sample(prompt=ASK), sampling_params=params,
                                                       evaluation=False, args=agentic_args(name)))).samples

            try:
                for count, name in enumerate(("hanging_agent", "blocking_agent", "silent_agent", "failing_agent"), 1):
                    with anyio.fail_after(30):  # far past the 1 s limit: the limit, not this, ends a hang
                        out = await episode(name)
                    assert out.status is SampleStatus.ABORTED and out.tokens == [] and not routed.sessions, name
                    assert bounds.in_a_row["agent"] == count, name
                assert (await episode("run_agent")).status is SampleStatus.COMPLETED
                assert bounds.in_a_row["agent"] == 0  # a usable episode starts the count over
                for _ in range(4):
                    await episode("silent_agent")
                with pytest.raises(HookBudgetSpent, match=r"--custom-agent-function-path 'tests\.support\."
                                   r"session_agent\.hanging_agent' failed 5 times in a row .*last: .*did not "
                                   r"return within 1 s \(--agent-timeout-s\)"):
                    await episode("hanging_agent")
                assert not routed.sessions
            finally:
                session_agent.RELEASE.set()
        tg.cancel_scope.cancel()


def _continue(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages that continue a session after its recorded turns: the last request, the reply, a user turn."""
    last = records[-1]
    return [*last["request"]["messages"], last["response"]["choices"][0]["message"],
            {"role": "user", "content": "more"}]
