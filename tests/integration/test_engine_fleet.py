"""EngineFleet and the launcher with real CPU engine processes.

Launches two engines, each from its own spec (one with a planned port already taken), kills one with SIGKILL,
checks the fleet marks it dead and relaunches it from its own spec; cancelling
the fleet leaves no process behind; an engine that crashes at start is reported with its log tail as soon as
it exits; external engines are attached and never killed.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
from pathlib import Path

import anyio
import psutil
import pytest

from coordinator.engines.client import EngineClient
from coordinator.engines.errors import EngineUnreachable
from coordinator.engines.fleet import EngineFleet, EngineHandle, EngineState
from coordinator.engines.launch import EngineLaunchError, EngineProcess
from coordinator.engines.policy import NO_RETRY
from coordinator.engines.spec import EngineLaunchSpec
from tests.support.waiting import wait_until

ENGINE_ENV = (("OMP_NUM_THREADS", "1"), ("MKL_NUM_THREADS", "1"))
PROMPT = {"text": "ab", "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}


def cpu_spec(model_dir: Path, *, start_timeout: float = 120.0) -> EngineLaunchSpec:
    return EngineLaunchSpec(
        kind="rayless", model_path=str(model_dir), env=ENGINE_ENV, start_timeout=start_timeout
    )


def group_alive(pid: int) -> bool:
    """Is any process of the group led by `pid` still running (zombies do not count)?"""
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(p.pid) == pid and p.status() != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, psutil.Error):
            continue
    return False


def placed(handle: EngineHandle) -> str:
    """The spec's marker in the environment of the engine process now running for `handle`."""
    assert handle.process is not None and handle.process.pid is not None
    return psutil.Process(handle.process.pid).environ()["RAYLESS_TEST_PLACED"]


async def test_fleet_launch_kill_mark_dead_relaunch_and_cancel(tiny_model_dir: Path, tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """Two engines, each from its own spec (its environment, its port) as the plan gives them; the first's planned
    port is taken, so it is replaced by another, with a warning. The second is killed, marked dead and relaunched
    from its own spec (not the group's first), on its port; cancelling the fleet leaves no process behind."""
    specs = [dataclasses.replace(cpu_spec(tiny_model_dir), env=(*ENGINE_ENV, ("RAYLESS_TEST_PLACED", str(i))))
             for i in range(2)]
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        specs[0] = dataclasses.replace(specs[0], port=taken)
        async with EngineClient(max_connections=16, retry=NO_RETRY) as client:
            fleet = EngineFleet(client=client, launch=specs, run_dir=tmp_path)
            assert [h.name for h in fleet.engines] == ["rollout-0", "rollout-1"]
            pids = await kill_and_relaunch(fleet, client, tiny_model_dir, tmp_path, taken, caplog)
    assert fleet.launch == specs, "the group's specs are never changed by a relaunch"
    assert all(h.state is EngineState.DEAD for h in fleet.engines)
    for pid in pids:
        assert not group_alive(pid), f"process group {pid} survived the fleet"
    log = (tmp_path / "logs" / "engine-rollout-1.log").read_text()
    assert log.count("=== rayless: starting engine rollout-1") == 2  # relaunch appends to the same log


async def kill_and_relaunch(fleet: EngineFleet, client: EngineClient, model_dir: Path, tmp_path: Path, taken: int,
                            caplog: pytest.LogCaptureFixture) -> list[int]:
    """The fleet running: the checks above, up to its cancellation. Returns the pid of every engine started."""
    pids: list[int] = []
    async with anyio.create_task_group() as tg:
        await tg.start(fleet.run)
        assert [h.state for h in fleet.engines] == [EngineState.ALIVE, EngineState.ALIVE]
        assert all(h.launched for h in fleet.engines)
        assert len({h.url for h in fleet.engines}) == 2
        other, victim = fleet.engines
        assert not other.url.endswith(f":{taken}")
        assert f"engine rollout-0: planned port {taken} on 127.0.0.1 is in use" in caplog.text
        assert [placed(other), placed(victim)] == ["0", "1"]
        for h in fleet.engines:
            assert (tmp_path / "logs" / f"engine-{h.name}.log").is_file()
            assert h.process is not None and h.process.pid is not None
            pids.append(h.process.pid)

        versions = await fleet.for_each_alive(lambda h: client.engine(h.url).get_weight_version())
        assert set(versions) == {"rollout-0", "rollout-1"}

        assert victim.process is not None and victim.process.pid is not None
        os.killpg(victim.process.pid, signal.SIGKILL)
        async def unreachable() -> bool:
            try:
                await client.engine(victim.url).generate(PROMPT)
            except EngineUnreachable:
                return True
            return False  # the kill lands within milliseconds; until then the engine still answers

        await wait_until(unreachable, timeout=30, interval=0.05, what="the killed engine unreachable")
        with anyio.fail_after(30):
            assert await fleet.check(victim) is False
        assert victim.state is EngineState.DEAD
        assert victim.dead_reason is not None and "exited" in victim.dead_reason
        assert fleet.alive() == [other]
        assert await fleet.wait_any_alive(timeout=1) == [other]
        assert await fleet.check(other) is True

        old_url, old_incarnation = victim.url, victim.incarnation
        brought_back: list[bool] = []

        async def relaunch() -> None:  # with this incarnation's weights given as arguments
            brought_back.append(await fleet.relaunch(victim, model_path=str(model_dir), weight_version="7"))

        async with anyio.create_task_group() as callers:  # two at once: one relaunch, the other waits
            callers.start_soon(relaunch)
            callers.start_soon(relaunch)
        assert sorted(brought_back) == [False, True]
        assert victim.state is EngineState.ALIVE
        assert victim.incarnation == old_incarnation + 1
        assert await client.engine(victim.url).get_weight_version() == "7"
        assert victim.url == old_url  # relaunch keeps the port when it is free
        assert placed(victim) == "1"  # relaunched from its own spec, not the group's first
        assert len((await client.engine(victim.url).generate(PROMPT)).replies) == 1
        assert victim.process is not None and victim.process.pid is not None
        pids.append(victim.process.pid)
        tg.cancel_scope.cancel()
    return pids


async def test_engine_crashing_at_start_reports_log_tail(tmp_path: Path) -> None:
    empty = tmp_path / "empty-model"
    empty.mkdir()
    async with EngineClient(max_connections=2) as client:
        # A long deadline: the error must come from watching the process, not from the deadline.
        ep = EngineProcess(
            cpu_spec(empty, start_timeout=600), name="broken", log_path=tmp_path / "b.log", client=client
        )
        with pytest.raises(EngineLaunchError) as err:
            await ep.start()
    assert err.value.returncode not in (None, 0)
    assert "exited with status" in str(err.value)
    assert "no config.json" in err.value.log_tail  # the engine's own complaint is in the message
    assert err.value.log_tail in str(err.value)
    assert ep.pid is not None and not group_alive(ep.pid)


async def test_fleet_start_failure_propagates_and_stops_the_others(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """One engine of the fleet fails to launch while the other is still starting: run() raises the failed one's
    EngineLaunchError (the other is cancelled and stopped) and no process is left running."""
    empty = tmp_path / "empty-model"
    empty.mkdir()
    async with EngineClient(max_connections=4, retry=NO_RETRY) as client:
        fleet = EngineFleet(client=client, launch=[cpu_spec(empty), cpu_spec(tiny_model_dir)], run_dir=tmp_path)
        with pytest.raises(EngineLaunchError) as err:  # the engine's own error, not an exception group
            await fleet.run()
        assert "exited with status" in str(err.value) and "rollout-0" in str(err.value)
        assert "no config.json" in err.value.log_tail
        for h in fleet.engines:
            assert h.process is not None and h.process.pid is not None
            assert not group_alive(h.process.pid)


async def test_external_engines_are_attached_not_killed(tiny_model_dir: Path, tmp_path: Path) -> None:
    async with EngineClient(max_connections=4, retry=NO_RETRY) as client:
        outside = EngineProcess(
            cpu_spec(tiny_model_dir), name="outside", log_path=tmp_path / "o.log", client=client
        )
        url = await outside.start()
        try:
            addr = url.removeprefix("http://")  # --rollout-external-engine-addrs gives host:port
            fleet = EngineFleet(client=client, external_urls=[addr], run_dir=tmp_path, group="eval")
            async with anyio.create_task_group() as tg:
                await tg.start(fleet.run)
                (h,) = fleet.engines
                assert (h.launched, h.state, h.url) == (False, EngineState.ALIVE, url)
                assert await fleet.check(h) is True

                fleet.mark_dead(h, "probe failures")
                fleet.mark_dead(h, "again")  # idempotent: the first reason stays
                assert (h.state, h.dead_reason) == (EngineState.DEAD, "probe failures")
                with pytest.raises(TimeoutError):
                    await fleet.wait_any_alive(timeout=0.2)
                woke: list[EngineHandle] = []

                async def waiter() -> None:
                    woke.extend(await fleet.wait_any_alive(timeout=120))

                tg.start_soon(waiter)
                await anyio.wait_all_tasks_blocked()
                assert woke == []
                await fleet.relaunch(h, timeout=30)  # external: waits until it answers, launches nothing
                assert h.state is EngineState.ALIVE
                await anyio.wait_all_tasks_blocked()
                assert woke == [h]  # the change event woke the waiting dispatcher
                tg.cancel_scope.cancel()
            assert outside.running(), "the fleet killed an engine it did not launch"
            await client.engine(url).health_generate()
        finally:
            await outside.stop()
