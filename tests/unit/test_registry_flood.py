"""A flood of silent sockets at node 0's registry (issue 24 item 5): at most `max_pending` of them hold a file
while they await their hello, the rest are closed unread at once, the log gets a line and a summary rather
than one line per socket, and a real node is still welcomed right after."""

from __future__ import annotations

import logging
import math
import re
import time
from pathlib import Path

import anyio
import psutil
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

from coordinator.nodes import wire
from tests.support.sockets import close_all, open_idle
from tests.support.waiting import wait_until
from tests.unit.test_nodes import free_port, hello_body, registry
from workers import protocol
from workers.boundary.http_server import raise_open_files_limit

FLOOD = 3000


async def test_a_flood_of_silent_sockets_holds_few_files_and_few_log_lines(tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    if raise_open_files_limit() < 2 * FLOOD + 256:
        pytest.skip(f"the open-files limit is below {2 * FLOOD + 256}, which the flood needs on both ends")
    caplog.set_level(logging.WARNING, logger="rayless")
    port = free_port()
    reg = registry(tmp_path, port)  # hello deadline 1 s
    me = psutil.Process()
    async with anyio.create_task_group() as tg:
        await tg.start(reg.run)
        before = me.num_fds()
        flood_started = time.monotonic()
        flood = await anyio.to_thread.run_sync(open_idle, "127.0.0.1", port, FLOOD)
        try:
            # every socket past the cap is closed unread as soon as it is accepted
            await wait_until(lambda: reg.refusal_log.total, until=lambda n: n >= FLOOD - reg.max_pending,
                             what="the flood's sockets past the cap refused", timeout=60)
            server_side = me.num_fds() - before - FLOOD
            assert server_side <= reg.max_pending + 32, server_side
            # and the ones awaiting their hello go after the (1 s) deadline
            await wait_until(lambda: reg.refusal_log.total, until=lambda n: n >= FLOOD,
                             what="the flood refused whole", timeout=60)
            flood_s = time.monotonic() - flood_started
        finally:
            close_all(flood)
        async with await anyio.connect_tcp("127.0.0.1", port) as stream:  # a real node is welcomed after it
            body = hello_body()
            await stream.send(protocol.HEADER.pack(len(body)) + body)
            assert isinstance(await wire.receive(BufferedByteReceiveStream(stream)), wire.NodeWelcome)
        tg.cancel_scope.cancel()
    lines = [r.getMessage() for r in caplog.records if "node registry refused" in r.getMessage()]
    # The log's bound, at most two lines per interval, over the intervals the flood spanned here (one on an idle
    # machine; a loaded one opens the sockets more slowly), and one more at the end; not one line per socket.
    intervals = math.ceil(flood_s / reg.refusal_log.interval_s) + 1
    assert 2 <= len(lines) <= 2 * intervals, (lines, flood_s)
    assert lines[0].startswith("node registry refused a connection from 127.0.0.1:"), lines  # the first, whole
    whole = [line for line in lines if line.startswith("node registry refused a connection from")]
    summed = [int(m[1]) for line in lines if (m := re.search(r"refused (\d+) more connections", line))]
    assert len(whole) + len(summed) == len(lines) and summed, lines
    assert len(whole) + sum(summed) == FLOOD, lines  # every refusal named or counted in a summary line
    assert len(reg.refusals) == 100 and reg.refusal_log.total == FLOOD
