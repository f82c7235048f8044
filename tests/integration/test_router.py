"""The real sglang-router (PyPI wheel, installed in .venv) in front of two real CPU engines.

Launches both engines and the router as child processes, generates through the router, removes and adds
workers through whichever worker API the installed router speaks, attaches an engine to it as a run given
`--sglang-router-ip/-port` does (the same engines serve both checks: each start costs seconds), and stops
everything; a run attached to a router someone else runs generates through it.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from coordinator.engines.client import EngineClient
from coordinator.engines.fleet import EngineFleet
from coordinator.engines.policy import NO_RETRY
from coordinator.engines.router import RouterError, RouterHandle
from coordinator.engines.spec import EngineLaunchSpec

pytest.importorskip("sglang_router")

ENGINE_ENV = (("OMP_NUM_THREADS", "1"), ("MKL_NUM_THREADS", "1"))


async def test_router_in_front_of_two_cpu_engines_and_an_engine_attaching_to_it(tiny_model_dir: Path,
                                                                                 tmp_path: Path) -> None:
    """Generation through the router, workers removed and added; then `--sglang-router-ip/-port`'s attach: a
    handle given the router's address launches nothing, registers our engine, serves through it, and leaves
    the router at the end without stopping it (it is not the attaching handle's to stop)."""
    spec = EngineLaunchSpec(kind="rayless", model_path=str(tiny_model_dir), env=ENGINE_ENV, start_timeout=120.0)
    async with EngineClient(max_connections=16, retry=NO_RETRY) as client:
        fleet = EngineFleet(client=client, launch=spec, num_engines=2, run_dir=tmp_path)
        router = RouterHandle(client=client, run_dir=tmp_path)
        async with anyio.create_task_group() as tg:
            await tg.start(fleet.run)
            urls = [h.url for h in fleet.engines]
            await tg.start(router.run, urls)
            assert router.api in ("workers", "legacy")
            assert sorted(await router.list_workers()) == sorted(urls)
            assert router.prometheus_port is not None and router.prometheus_port != router.port

            via = client.engine(router.url)
            payload = {
                "text": "abc",
                "rid": "r-1",
                "sampling_params": {"max_new_tokens": 3, "temperature": 0.0},
            }
            (out,) = (await via.generate(payload)).replies
            assert isinstance(out.text, str)
            (direct,) = (await client.engine(urls[0]).generate(dict(payload, rid="r-2"))).replies
            assert out.text == direct.text  # same weights, greedy: same text whichever worker served

            await router.remove_worker(urls[0])
            assert await router.list_workers() == [urls[1]]
            for i in range(3):
                assert len((await via.generate(dict(payload, rid=f"r-after-remove-{i}"))).replies) == 1

            host, port = router.url.removeprefix("http://").rsplit(":", 1)
            ours = RouterHandle(client=client, run_dir=tmp_path, address=f"{host}:{port}")
            async with anyio.create_task_group() as attached:
                await attached.start(ours.run, [urls[0]])
                assert ours.proc is None and ours.url == router.url
                assert sorted(await router.list_workers()) == sorted(urls)  # ours joined
                out = await client.engine(ours.url).generate(
                    {"text": "abc", "rid": "r-attached", "sampling_params": {"max_new_tokens": 2}})
                assert isinstance(out.replies[0].text, str)
                attached.cancel_scope.cancel()
            assert await router.list_workers() == [urls[1]]  # ours left
            assert router.proc is not None and router.proc.returncode is None  # still running: not ours to stop

            await router.add_worker(urls[0])
            assert sorted(await router.list_workers()) == sorted(urls)
            assert len((await via.generate(dict(payload, rid="r-after-add"))).replies) == 1
            tg.cancel_scope.cancel()
        assert router.proc is not None and router.proc.returncode is not None
        assert (tmp_path / "logs" / "router-rollout.log").is_file()


async def test_attaching_to_an_address_where_no_router_answers_is_refused(tmp_path: Path) -> None:
    with pytest.raises(RouterError, match="no sglang-router answers"):
        async with EngineClient(max_connections=4, retry=NO_RETRY) as client:
            await RouterHandle(client=client, run_dir=tmp_path, address="127.0.0.1:9", start_timeout=2.0).run()


async def test_a_run_attached_to_a_running_router_generates_through_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    """`rayless train --sglang-router-ip/-port`: the run's engine joins the router (every request goes through
    it, so a run whose engine was never registered fails), and leaves it when the run ends."""
    from coordinator.config import parse_config
    from coordinator.run import run_training

    async with EngineClient(max_connections=4, retry=NO_RETRY) as client:
        theirs = RouterHandle(client=client, run_dir=tmp_path, name="theirs")
        async with anyio.create_task_group() as tg:
            await tg.start(theirs.run, [])
            host, port = theirs.url.removeprefix("http://").rsplit(":", 1)
            config = parse_config([
                "--hf-checkpoint", str(tiny_model_dir), "--prompt-data", "builtin:first_digit", "--rm-type",
                "first_digit", "--rollout-num-engines", "1", "--debug-rollout-only", "--rollout-batch-size", "2",
                "--n-samples-per-prompt", "2", "--num-rollout", "1", "--rollout-max-response-len", "4",
                "--use-sglang-router", "--sglang-router-ip", host, "--sglang-router-port", port,
                "--run-dir", str(tmp_path / "run"), "--no-progress"])
            summary = await run_training(config)
            assert summary["rollouts"] == 1
            assert await theirs.list_workers() == []
            tg.cancel_scope.cancel()
