"""Pure directed-graph algorithms: topological order, cycle report, diff.

Nothing here knows what a resource is; vertices are any hashable values.
"""

from evergraph.graph.dag import DAG, CycleError, diff_keys, topo_order

__all__ = ["DAG", "CycleError", "diff_keys", "topo_order"]
