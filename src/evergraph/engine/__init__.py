"""The graph engine: vertices, scheduling, meta parameters, convergence.

Resources import only `evergraph.engine.contract`.
"""

from evergraph.engine.contract import (
    Handle,
    Meta,
    Registry,
    Resource,
    default_registry,
    doc,
    register,
)
from evergraph.engine.model import Edge, GraphModel

__all__ = [
    "Edge",
    "GraphModel",
    "Handle",
    "Meta",
    "Registry",
    "Resource",
    "default_registry",
    "doc",
    "register",
]
