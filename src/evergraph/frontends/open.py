"""Which frontend reads a graph: the one door the agent and the CLI open frontends
by (kept apart from base.py so that the YAML and Python frontends stay independent
of each other). The agent imports no particular frontend (an import-linter contract
keeps it so): a graph file's frontend is chosen by suffix from `FILE_FRONTENDS`, and
each frontend module is imported only when a graph of its kind is read."""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from evergraph.engine.contract import Registry, default_registry
from evergraph.errors import InputError
from evergraph.frontends.base import Frontend

if TYPE_CHECKING:
    from evergraph.engine.model import GraphModel
    from evergraph.frontends.python import Graph as Graph

#: graph file suffix -> (module, class) of the frontend that reads it
FILE_FRONTENDS: dict[str, tuple[str, str]] = {
    ".yaml": ("evergraph.frontends.yaml", "YamlFrontend"),
    ".yml": ("evergraph.frontends.yaml", "YamlFrontend"),
    ".py": ("evergraph.frontends.python", "PythonFrontend"),
}

#: the frontend of an agent run without FILE: it follows the newest deploy in the World
#: (and opens each deploy's graph file through `open_frontend`: named here, not
#: imported, so that the two modules do not import each other)
DEPLOYS = "evergraph.frontends.deploy"


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
    where = FILE_FRONTENDS.get(p.suffix)
    if where is None:
        raise InputError(
            f"unsupported graph file type {p.suffix or '(none)'!r}: expected .yaml, .yml or .py",
            str(p),
        )
    module, name = where
    cls: type[Frontend] = getattr(importlib.import_module(module), name)
    return cls(p, registry)  # type: ignore[call-arg]  # a file frontend takes (path, registry)


def frontend_for(target: Frontend | Graph | str | os.PathLike[str] | None) -> Frontend:
    """The frontend for what `run` was given: a Graph, a .yaml/.yml/.py path, or
    None (follow the newest deploy in the World)."""
    from evergraph.frontends.base import Static

    if isinstance(target, Frontend):
        return target
    if target is None:
        follower: Frontend = importlib.import_module(DEPLOYS).DeployFrontend(builtin_registry())
        return follower
    if isinstance(target, str | os.PathLike):
        return open_frontend(target, builtin_registry())
    # imported here: the Python frontend (and the World's exports under it) is
    # not needed for a graph file of another kind
    from evergraph.frontends.python import Graph as Graph

    if isinstance(target, Graph):
        return Static(target.model(), label=target.name or "graph")
    raise InputError(f"run() takes a Graph or a path to a graph file, not {type(target).__name__}")


def trust_deployers(frontend: Frontend, keys: Sequence[str]) -> None:
    """Make an agent following deploys run only those signed by `keys` (`run
    --deployer`); InputError for a bad key or a frontend that does not follow deploys."""
    importlib.import_module(DEPLOYS).trust_deployers(frontend, keys)


def parse_fragment(text: str, filename: str, registry: Registry) -> GraphModel:
    """A graph fragment given as YAML text (a farm request's), parsed and validated;
    InputError naming `filename:line:col`."""
    from evergraph.frontends.yaml import parse_yaml

    return parse_yaml(text, filename, registry)
