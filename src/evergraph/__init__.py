"""evergraph: event-driven, parallel configuration management.

`import evergraph` gives the engine the CLI uses::

    import evergraph

    g = evergraph.Graph("demo")
    conf = g.add("file", "conf", path="/tmp/demo/app.conf", content="listen=8080\\n")
    reload = g.add("exec", "reload", cmd="echo reloaded")
    g.edge(conf, reload, notify=True)
    status = evergraph.run(g, state_dir="/tmp/demo-state", converged_exit=True)

`run` also takes the path of a YAML or Python graph file. New resource kinds
subclass `Resource` and are registered with `@register("kind")`. See
docs/python.md and docs/architecture.md.

The names are imported on first use, so that `import evergraph` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from evergraph._version import __version__

__all__ = [
    "Collected",
    "Graph",
    "InputError",
    "Member",
    "Meta",
    "Ref",
    "Resource",
    "World",
    "WorldOptions",
    "__version__",
    "doc",
    "register",
    "run",
]

if TYPE_CHECKING:
    from evergraph.agent.api import run
    from evergraph.cluster.members import Member
    from evergraph.engine.contract import Meta, Resource, doc, register
    from evergraph.errors import InputError
    from evergraph.frontends.python import Collected, Graph, Ref, World
    from evergraph.world.open import WorldOptions

_WHERE = {
    "run": "evergraph.agent.api",
    "Meta": "evergraph.engine.contract",
    "Resource": "evergraph.engine.contract",
    "doc": "evergraph.engine.contract",
    "register": "evergraph.engine.contract",
    "InputError": "evergraph.errors",
    "Collected": "evergraph.frontends.python",
    "Graph": "evergraph.frontends.python",
    "Ref": "evergraph.frontends.python",
    "World": "evergraph.frontends.python",
    "Member": "evergraph.cluster.members",
    "WorldOptions": "evergraph.world.open",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'evergraph' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
