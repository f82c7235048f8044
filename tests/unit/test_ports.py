"""Planned ports at launch: taken when free; replaced by another, with a warning, when something holds them
(engines, the router and the control channel alike); a port the user fixed (`--control-port`) is never
replaced."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from coordinator.engines.spec import claim_port, port_is_free
from coordinator.train.group import TrainGroup
from coordinator.train.torchrun import TorchrunSpec


@pytest.fixture
def taken() -> Iterator[int]:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        yield squatter.getsockname()[1]


def test_a_taken_planned_port_is_replaced_with_a_warning(taken: int, caplog: pytest.LogCaptureFixture) -> None:
    assert not port_is_free("127.0.0.1", taken)
    with caplog.at_level(logging.WARNING, logger="rayless"):
        port = claim_port("127.0.0.1", taken, what="engine rollout-3")
    assert port != taken and port_is_free("127.0.0.1", port)
    assert f"engine rollout-3: planned port {taken} on 127.0.0.1 is in use; using port {port} instead" in caplog.text
    free = claim_port("127.0.0.1", None, what="x")
    assert claim_port("127.0.0.1", free, what="x") == free


async def test_the_control_channel_moves_off_a_taken_planned_port_unless_it_was_fixed(
        taken: int, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    planned = TrainGroup(TorchrunSpec(nproc_per_node=1), run_dir=tmp_path, port=taken, port_fixed=False, launch=False)
    with caplog.at_level(logging.WARNING), anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(planned.run)  # launches nothing: it listens and waits for a rank
            await planned.listening.wait()
            assert planned.address is not None and int(planned.address.rsplit(":", 1)[1]) != taken
            tg.cancel_scope.cancel()
    assert f"control channel: planned port {taken} on 127.0.0.1 is in use" in caplog.text
    fixed = TrainGroup(TorchrunSpec(nproc_per_node=1), run_dir=tmp_path, port=taken, port_fixed=True, launch=False)
    with pytest.raises(OSError), anyio.fail_after(30):
        await fixed.run()
