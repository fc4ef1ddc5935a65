"""Pending refreshes, persisted: `vertices/<kind>/<name>/refresh` exists while one is owed.

A notify edge's refresh is written to disk *before* the child is scheduled
and removed only after the child served it with a successful apply, so a
crash (kill -9) anywhere in between leaves the file, and the next start
refreshes the child exactly once.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote

from evergraph.engine.vertex import vertex_dir

if TYPE_CHECKING:
    from evergraph.engine.vertex import Vertex

log = logging.getLogger("evergraph.engine")

FLAG = "refresh"


class RefreshStore:
    def __init__(self, state_dir: Path) -> None:
        self.root = state_dir / "vertices"
        self.state_dir = state_dir

    def owe(self, v: Vertex) -> None:
        d = vertex_dir(self.state_dir, v.res.kind, v.res.name)
        try:
            d.mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = d / f".{FLAG}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, b"1\n")
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, d / FLAG)
        except OSError as e:
            log.error("%s: cannot persist its pending refresh: %s", v.ident, e)

    def served(self, v: Vertex) -> None:
        try:
            os.unlink(vertex_dir(self.state_dir, v.res.kind, v.res.name) / FLAG)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.error("%s: cannot clear its served refresh: %s", v.ident, e)

    def load(self) -> set[str]:
        """Identities (`kind[name]`) with a refresh owed from an earlier run."""
        owed: set[str] = set()
        try:
            kinds = list(os.scandir(self.root))
        except FileNotFoundError:
            return owed
        for kind in kinds:
            if not kind.is_dir():
                continue
            for name in os.scandir(kind.path):
                if os.path.exists(os.path.join(name.path, FLAG)):
                    owed.add(f"{kind.name}[{unquote(name.name)}]")
        if owed:
            log.info("%d refreshes owed from the last run: %s", len(owed), ", ".join(sorted(owed)))
        return owed
