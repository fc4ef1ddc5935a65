"""Which frontend reads a graph file (kept apart from base.py so that the YAML and
Python frontends stay independent of each other)."""

from __future__ import annotations

import os
from pathlib import Path

from evergraph.engine.contract import Registry, default_registry
from evergraph.errors import InputError
from evergraph.frontends.base import Frontend


def builtin_registry() -> Registry:
    """The registry with every built-in kind registered."""
    import evergraph.resources  # noqa: F401  (registers the built-in kinds)

    return default_registry


def open_graph_file(path: str | os.PathLike[str]) -> Frontend:
    """The frontend for a graph file, with the built-in kinds (what `check` and
    `graph` need, without the agent's imports)."""
    return open_frontend(path, builtin_registry())


def open_frontend(path: str | os.PathLike[str], registry: Registry) -> Frontend:
    """The frontend for a graph file, by its suffix (InputError for others)."""
    p = Path(path)
    if p.suffix in (".yaml", ".yml"):
        from evergraph.frontends.yaml import YamlFrontend

        return YamlFrontend(p, registry)
    if p.suffix == ".py":
        from evergraph.frontends.python import PythonFrontend

        return PythonFrontend(p, registry)
    raise InputError(
        f"unsupported graph file type {p.suffix or '(none)'!r}: expected .yaml, .yml or .py",
        str(p),
    )
