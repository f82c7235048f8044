"""How long a stopped torchrun may take to exit by itself: `grace_s`, unless its ranks have left their loop
(`ranks_left` returned), then `exit_timeout_s`. A stand-in plays torchrun: a process that exits 0 once told
(a file appears), and dies of SIGTERM otherwise."""

from __future__ import annotations

import functools
import signal
import stat
import sys
from pathlib import Path

import anyio

from coordinator.processes import exit_status
from coordinator.train.torchrun import TorchrunProcess, TorchrunSpec
from tests.support.waiting import wait_until
from workers import protocol

STANDIN = f"""#!{sys.executable}
import os, time
while not os.path.exists(os.environ["STANDIN_GO"]):  # a clean exit under way, as long as it takes
    time.sleep(0.05)
"""


def standin(tmp_path: Path, name: str, go: Path) -> TorchrunProcess:
    script = tmp_path / "torchrun-standin"
    script.write_text(STANDIN)
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return TorchrunProcess(TorchrunSpec(nproc_per_node=1, python=str(script)), log_path=tmp_path / f"{name}.log",
                           grace_s=0.3, exit_timeout_s=120, extra_env={"STANDIN_GO": str(go)})


async def test_a_torchrun_whose_ranks_left_gets_its_exit_timeout_the_others_their_grace(tmp_path: Path) -> None:
    go = tmp_path / "go"
    control_env = {protocol.ENV_ADDR: "127.0.0.1:9", protocol.ENV_TOKEN: "t" * 32}
    leaving, stuck = standin(tmp_path, "leaving", go), standin(tmp_path, "stuck", go)
    await leaving.start(control_env)
    await stuck.start(control_env)
    assert leaving.proc is not None and stuck.proc is not None

    async def ranks_left() -> None:
        return  # every rank closed its connection

    async def ranks_stay() -> None:
        await anyio.sleep_forever()  # a rank busy in a command never reads its shutdown

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(leaving.stop, ranks_left=ranks_left))
            tg.start_soon(functools.partial(stuck.stop, ranks_left=ranks_stay))
            # The clock: the stuck one's grace has run out once it is ended.
            await wait_until(lambda: exit_status(stuck.proc), until=lambda code: code is not None, timeout=30,
                             what="the stuck torchrun ended after its grace")
            assert exit_status(leaving.proc) is None, "a torchrun whose ranks left was ended at the grace"
            go.touch()
    assert stuck.proc.returncode == -signal.SIGTERM
    assert leaving.proc.returncode == 0
