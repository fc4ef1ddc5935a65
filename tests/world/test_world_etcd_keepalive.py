"""A keep-alive whose event loop was busy past its deadline is retried, never fatal.

Found by the 10,000-host World benchmark (BENCHMARKS.md, issue 15): the collector,
applying 10,000 collected files at once, held its event loop past the keep-alive's
first deadline (0.5 s); the stream's next step then failed with grpc's own
ExecuteBatchError (not an RpcError), which ended the membership service and the
agent. Depending on the step the loop was blocked at, the same late stream ends as
ExecuteBatchError, INTERNAL ("Internal error from Core"), etcd's UNKNOWN "context
deadline exceeded" or DEADLINE_EXCEEDED; all must be retried like a deadline.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from evergraph.world.etcd import EtcdKV
from evergraph.world.etcd_server import EtcdServer

pytestmark = pytest.mark.slow


def test_a_keepalive_blocked_past_its_deadline_at_any_step_is_retried(
    shm: Path, servers: list[EtcdServer]
) -> None:
    server = EtcdServer.single(shm / "data")
    servers.append(server)
    server.start()
    outcomes: list[str] = []

    async def main() -> None:
        async with EtcdKV([server.client_url]) as kv:
            lease = await kv.grant(30)
            # block the loop after 0..9 turns of the keep-alive's steps, for longer
            # than its first attempt may take (0.5 s): each step meets a dead stream
            for turns in range(10):
                task = asyncio.create_task(kv.keepalive(lease))
                for _ in range(turns):
                    await asyncio.sleep(0)
                time.sleep(0.6)  # noqa: ASYNC251 (the busy event loop under test)
                try:
                    await task
                    outcomes.append("ok")
                except Exception as e:  # what the agent's membership would die of
                    outcomes.append(f"{type(e).__name__}: {e}")

    asyncio.run(main())
    assert outcomes == ["ok"] * 10
