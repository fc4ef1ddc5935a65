"""What a worker discovers about itself: added to its capabilities, and its UUID,
kept in the state dir so it is the same worker after a restart."""

from __future__ import annotations

import os
import platform
import socket
import uuid
from pathlib import Path

from evergraph._util.atomic import atomic_write


def discovered() -> dict[str, str]:
    """arch, os, cpus, memory_mb, hostname."""
    facts = {
        "arch": platform.machine() or "unknown",
        "os": platform.system().lower() or "unknown",
        "cpus": str(os.cpu_count() or 1),
        "hostname": socket.gethostname(),
    }
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    facts["memory_mb"] = str(int(line.split()[1]) // 1024)
                    break
    except OSError:
        pass
    return facts


def worker_uuid(state_dir: Path) -> str:
    """This worker's UUID: made once, kept in `STATE/worker.uuid`."""
    path = state_dir / "worker.uuid"
    try:
        text = path.read_text().strip()
        return str(uuid.UUID(text))
    except (FileNotFoundError, ValueError):
        pass
    atomic_write(path, f"{uuid.uuid4()}\n".encode(), mode=0o600, exclusive=True)
    try:
        return str(uuid.UUID(path.read_text().strip()))
    except ValueError:
        raise ValueError(f"{path}: not a UUID (remove it to make a new one)") from None


def parse_caps(items: tuple[str, ...] | list[str]) -> dict[str, str]:
    """`--cap k=v` values; ValueError naming the bad one."""
    out: dict[str, str] = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep or not k.strip():
            raise ValueError(f"{item!r} is not KEY=VALUE")
        out[k.strip()] = v.strip()
    return out
