"""A client of a self-forming cluster, run inside a NetBed host (`h.spawn(*argv)`):

- `count`: the counter writer. Increments `test/counter` by compare-and-swap
  transactions (read the value and its mod revision, then a txn that writes
  value+1 only if the mod revision is still the one read) and journals every
  outcome as one JSON line, fsynced before the next operation:
  `{"ack": v, "rev": r}` (etcd acknowledged the write of v at revision r),
  `{"err": why, "op": ..., "v": v}` (an error; a failed txn's outcome is
  unknown), `{"landed": v}` (a write of v whose outcome was unknown was found
  applied), `{"conflict": v}` (the txn's compare failed), `{"odd": v, "last": l}`
  (the counter read is neither the last applied value nor the next one after an
  unknown write: a rollback or a foreign writer). Each line has the time `t`
  (time.time()). SIGTERM ends it after the operation in flight.
- `read`: prints `{"value", "rev", "history"}`: the counter now and every value
  it held from revision `--since` on, read back from etcd's history (a watch),
  so a test can see that each increment was applied once.
- `put`: writes the base64 JSON `[[key, value_b64], ...]` read on stdin (the
  attacker of the identity tests, holding a member's TLS files).

Every command takes `--tls DIR` (a state dir's `cluster/`: ca.crt, node.crt,
node.key) and `--endpoints URL,...` (the client URLs of all hosts).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import IO, Any

from evergraph.world.etcd import EtcdKV
from evergraph.world.kv import Compare, Put, WorldError

KEY = "test/counter"


class Journal:
    def __init__(self, path: Path) -> None:
        self.f: IO[bytes] = open(path, "ab")  # noqa: SIM115 - closed by close()

    def write(self, **rec: Any) -> None:
        rec["t"] = time.time()
        self.f.write(json.dumps(rec).encode() + b"\n")
        self.f.flush()
        os.fsync(self.f.fileno())

    def close(self) -> None:
        self.f.close()


def _kv(args: argparse.Namespace, timeout: float = 5.0) -> EtcdKV:
    d = Path(args.tls)
    return EtcdKV(
        args.endpoints.split(","),
        ca=d / "ca.crt",
        cert=d / "node.crt",
        key=d / "node.key",
        timeout=timeout,
    )


async def count(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    j = Journal(Path(args.journal))
    kv = _kv(args, args.timeout)
    j.write(event="start")
    last = 0  # the last value known applied (acknowledged, or found landed)
    unknown: set[int] = set()  # values written with an unknown outcome
    try:
        while not stop.is_set():
            try:
                cur = await kv.get(KEY)
            except WorldError as e:
                j.write(err=str(e), op="get")
                await _pause(stop, 0.05)
                continue
            value = int(cur.value) if cur is not None else 0
            rev = cur.mod_revision if cur is not None else 0
            if value > last and all(v in unknown for v in range(last + 1, value + 1)):
                for v in range(last + 1, value + 1):
                    j.write(landed=v, rev=rev)
                last = value
            elif value != last:
                j.write(odd=value, last=last)
                last = max(last, value)
            nxt = value + 1
            try:
                done = await kv.txn([Compare(KEY, rev)], [Put(KEY, str(nxt).encode())])
            except WorldError as e:
                unknown.add(nxt)
                j.write(err=str(e), op="txn", v=nxt)
                await _pause(stop, 0.05)
                continue
            if done is None:
                # the counter moved since our read: with one writer, only an earlier
                # write of ours whose outcome was unknown (the next read shows it)
                j.write(conflict=nxt)
                continue
            unknown.clear()
            j.write(ack=nxt, rev=done)
            last = nxt
            if args.every:
                await _pause(stop, args.every)
    finally:
        j.write(event="stop")
        j.close()
        await kv.close()


async def _pause(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except TimeoutError:
        pass


async def read(args: argparse.Namespace) -> None:
    kv = _kv(args, 10.0)
    try:
        cur = await kv.get(KEY)
        out: dict[str, Any] = {
            "value": int(cur.value) if cur is not None else 0,
            "rev": cur.mod_revision if cur is not None else 0,
            "history": [],
        }
        if cur is not None and args.since:
            history: list[list[int]] = []
            stream = kv.watch(KEY, args.since)
            async with asyncio.timeout(30):
                async for batch in stream:
                    for ev in batch:
                        if ev.key == KEY and ev.type == "put":
                            history.append([int(ev.value), ev.revision])
                    if history and history[-1][1] >= cur.mod_revision:
                        break
            out["history"] = history
        print(json.dumps(out))
    finally:
        await kv.close()


async def put(args: argparse.Namespace) -> None:
    items = json.loads(sys.stdin.read())
    kv = _kv(args, 10.0)
    try:
        for key, value in items:
            await kv.put(key, base64.b64decode(value))
    finally:
        await kv.close()


def main() -> None:
    p = argparse.ArgumentParser(prog="cluster_client")
    p.add_argument("command", choices=("count", "read", "put"))
    p.add_argument("--tls", required=True)
    p.add_argument("--endpoints", required=True)
    p.add_argument("--journal", help="count: the journal file")
    p.add_argument("--every", type=float, default=0.0, help="count: seconds between writes")
    p.add_argument("--timeout", type=float, default=5.0, help="count: seconds per operation")
    p.add_argument("--since", type=int, default=0, help="read: history from this revision")
    args = p.parse_args()
    asyncio.run({"count": count, "read": read, "put": put}[args.command](args))


if __name__ == "__main__":
    main()
