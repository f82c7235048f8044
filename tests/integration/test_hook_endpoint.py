"""The coordinator's `/generate` for hooks, in front of two real CPU engines.

A hook's `post` (inside the hook call the rollout opens) reaches the endpoint with its route: every request of
one prompt group lands on the group's engine, two groups on two engines (the default path's least-in-flight
pick), each request seeded from its route, so the same request draws the same tokens. When the group's engine
is killed the next request is served by the other one; one without a route (a hook's own HTTP client) is
dispatched like any. The engines' API key is required from clients and sent by `post` to this address only;
bad requests get JSON errors with the status a client can act on.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import anyio
import httpx

from coordinator.engines.client import EngineClient
from coordinator.engines.fleet import EngineFleet
from coordinator.engines.spec import EngineLaunchSpec
from coordinator.hooks import post
from coordinator.hooks.http import outgoing_headers
from coordinator.hooks.runtime import ROUTE_HEADER, GroupRoute, HookRuntime, Route, hook_call
from coordinator.rollout.dispatch import Dispatcher
from coordinator.rollout.hook_endpoint import ENGINE_HEADER, HookEndpoint

KEY = "hook-endpoint-key-5d1"
ENV = (("OMP_NUM_THREADS", "1"), ("MKL_NUM_THREADS", "1"))


def payload(tokens: list[int], n: int = 3) -> dict:
    return {"input_ids": tokens, "return_logprob": True,
            "sampling_params": {"max_new_tokens": n, "temperature": 1.0}}


async def test_the_endpoint_keeps_groups_on_their_engine_and_routes_around_a_dead_one(tiny_model_dir: Path,
                                                                                       tmp_path: Path) -> None:
    spec = EngineLaunchSpec(kind="rayless", model_path=str(tiny_model_dir), env=ENV, start_timeout=120.0,
                            api_key=KEY)
    async with EngineClient(max_connections=32, api_key=KEY) as client, anyio.create_task_group() as tg:
        fleet = EngineFleet(client=client, launch=spec, num_engines=2, run_dir=tmp_path)
        await tg.start(fleet.run)
        for handle in fleet.engines:  # each engine answers with its own name as its weight version
            await client.engine(handle.url).update_weight_version(handle.name)
        dispatcher = Dispatcher(client=client, pool=fleet, engine_wait=5.0)  # how long a request waits for one
        runtime = HookRuntime(args=argparse.Namespace(), api_key=KEY)
        endpoint = HookEndpoint(dispatcher=dispatcher, routes=runtime.routes, seed=7, api_key=KEY,
                                max_body_bytes=4096)
        await tg.start(endpoint.run)
        runtime.bind_address(endpoint.host, endpoint.port)
        url = f"{endpoint.url}/generate"
        async with runtime:
            served: dict[int, set[str]] = {0: set(), 1: set()}
            outputs: dict[tuple[int, int], list[int]] = {}
            async with dispatcher.group_engine() as first, dispatcher.group_engine() as second:
                assert first.url != second.url  # the second group goes to the less loaded engine
                for group_index, engine in ((0, first), (1, second)):
                    group = GroupRoute(rollout_id=3, group_index=group_index, engine=engine)
                    for sample_index in range(3):
                        with runtime.routes.open(Route(group, sample_index)) as token, hook_call(runtime, token):
                            out = await post(url, payload([5, 6, 7, 8]))
                            again = await post(url, payload([5, 6, 7, 8]))
                        served[group_index].add(out["meta_info"]["weight_version"])
                        outputs[(group_index, sample_index)] = out["output_ids"]
                        assert again["output_ids"] == out["output_ids"]  # seeded from its route: same draw
            assert len(runtime.routes) == 0  # a route lives only while its hook call runs
            # one engine per group
            assert served == {0: {first.name}, 1: {second.name}}, served
            assert len(set(map(tuple, outputs.values()))) > 1  # different samples draw differently

            # The engine of group 0 dies: its next request is served by the other engine.
            assert first.process is not None and first.process.pid is not None
            os.killpg(first.process.pid, signal.SIGKILL)
            group = GroupRoute(rollout_id=3, group_index=0, engine=first)
            with runtime.routes.open(Route(group, 0)) as token, hook_call(runtime, token):
                out = await post(url, payload([5, 6, 7, 8]))
            assert out["meta_info"]["weight_version"] == second.name
            assert group.engine is second and first.url not in [h.url for h in fleet.alive()]

            # The key travels to this address only; without it the endpoint refuses, as SGLang does.
            with hook_call(runtime, "t"):
                assert outgoing_headers(url, None) == {ROUTE_HEADER: "t", "Authorization": f"Bearer {KEY}"}
                assert outgoing_headers("http://127.0.0.1:9/retrieve", None) == {}
            async with httpx.AsyncClient(timeout=30) as http:
                refused = await http.post(url, json=payload([5, 6]))
                assert refused.status_code == 401 and "API key" in refused.json()["error"]["message"]
                auth = {"Authorization": f"Bearer {KEY}"}
                # A request without a route (a hook with its own HTTP client) is dispatched like any request.
                ok = await http.post(url, json=payload([5, 6], n=2), headers=auth)
                assert ok.status_code == 200 and ok.headers[ENGINE_HEADER] == second.url
                assert len(ok.json()["output_ids"]) == 2
                assert (await http.get(f"{endpoint.url}/health", headers=auth)).status_code == 200
                missing = await http.post(f"{endpoint.url}/v1/chat/completions", json={}, headers=auth)
                assert missing.status_code == 404 and "POST /generate" in missing.json()["error"]["message"]
                assert (await http.get(url, headers=auth)).status_code == 405
                bad = await http.post(url, content=b"{not json", headers=auth)
                assert bad.status_code == 400 and "not JSON" in bad.json()["error"]["message"]
                engine_4xx = await http.post(url, json={"input_ids": [5], "sampling_params": {"nope": 1}},
                                             headers=auth)
                assert engine_4xx.status_code == 400 and "nope" in engine_4xx.json()["error"]["message"]
                big = await http.post(url, json=payload(list(range(2000))), headers=auth)
                assert big.status_code == 413
                # the connection survives answered errors: one more request on the same client
                assert (await http.post(url, json=payload([5, 6]), headers=auth)).status_code == 200

            # The last engine dies too: a request gets a JSON 503, not a traceback, whether it finds the engine
            # dead on the way (the first, which marks it dead) or its route's engine already dead (the second).
            assert second.process is not None and second.process.pid is not None
            os.killpg(second.process.pid, signal.SIGKILL)
            auth = {"Authorization": f"Bearer {KEY}"}
            group = GroupRoute(rollout_id=3, group_index=1, engine=second)
            async with httpx.AsyncClient(timeout=60) as http:
                unrouted = await http.post(url, json=payload([5, 6]), headers=auth)
                assert not second.alive
                with runtime.routes.open(Route(group, 0)) as token:
                    routed = await http.post(url, json=payload([5, 6]), headers={**auth, ROUTE_HEADER: token})
            for gone in (unrouted, routed):
                assert gone.status_code == 503 and "no rollout engine alive" in gone.json()["error"]["message"]
        tg.cancel_scope.cancel()

