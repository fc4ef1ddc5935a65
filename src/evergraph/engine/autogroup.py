"""Automatic grouping: vertices of a groupable kind that cannot reach each other merge.

Grouping is hierarchical: a kind `a:b` joins the family of kind `a` (see
`Resource.group_key`), and a parent kind leads its family's group when present.

The merged vertex's resource (the group's leader, first in graph order) runs
one `check_apply_group` for all members — for packages, one transaction. We
keep, for each vertex of the quotient graph, the set of original vertices it
reaches as a Python int used as a bitset; merging two vertices is allowed only
when neither reaches the other, which is exactly when the merge cannot close
a cycle, and the closure is updated in place after each merge.

A candidate with no edges at all (the common case: thousands of packages or
noops) reaches nothing and is reached by nothing: it can join any group of its
key without closing a cycle, and it adds nothing to anyone's reachability, so it
joins the first group of its key in O(1), with no closure update. Only vertices
with edges pay for the closure (that update is what was quadratic: 8,000 noops
took 12 s, 50,000 never finished).
"""

from __future__ import annotations

from evergraph.engine.model import Edge, GraphModel

#: the O(1) join of isolated candidates (a test compares it with the general path)
_FAST = True


def group_vertices(model: GraphModel) -> int:
    """Group in place; returns how many vertices were merged away."""
    candidates = [
        ident
        for ident, res in model.resources.items()
        if res.groupable and res.meta.autogroup and not res.meta.hidden
    ]
    # Parent kinds first, so that a family's group is led by `a`, not `a:b`.
    candidates.sort(key=lambda ident: ":" in model.resources[ident].kind)
    if len(candidates) < 2:
        return 0
    order = model.order()
    index = {v: i for i, v in enumerate(order)}
    children: dict[str, list[str]] = {v: [] for v in order}
    for e in model.edges:
        children[e.from_id].append(e.to_id)
    # reach[i]: bitset of vertices reachable from i (excluding i itself)
    reach = [0] * len(order)
    for v in reversed(order):
        r = 0
        for c in children[v]:
            ci = index[c]
            r |= reach[ci] | (1 << ci)
        reach[index[v]] = r
    # members[i]: bitset of original vertices merged into node i
    leader_of: dict[str, str] = {}
    members: dict[int, int] = {}
    groups: dict[tuple[object, ...], list[int]] = {}
    has_parent = {e.to_id for e in model.edges}
    merged = 0
    for ident in candidates:
        res = model.resources[ident]
        i = index[ident]
        key = res.group_key()
        placed = False
        key_groups = groups.setdefault(key, [])
        if _FAST and key_groups and not reach[i] and ident not in has_parent:
            gi = key_groups[0]  # isolated: joins at once (see the module doc)
            members[gi] |= 1 << i
            leader_of[ident] = order[gi]
            merged += 1
            continue
        for gi in key_groups:
            gm = members[gi]
            if reach[gi] & (1 << i) or reach[i] & gm:
                continue  # one reaches the other: merging would close a cycle
            new_members = gm | (1 << i)
            new_reach = (reach[gi] | reach[i]) & ~new_members
            members[gi] = new_members
            reach[gi] = new_reach
            # everything that reached either now reaches the whole group and beyond
            for node in members:
                if node != gi and reach[node] & new_members:
                    reach[node] |= new_reach | new_members
            for j in range(len(order)):
                if j not in members and reach[j] & new_members:
                    reach[j] |= new_reach | new_members
            leader_of[ident] = order[gi]
            placed = True
            merged += 1
            break
        if not placed:
            groups[key].append(i)
            members[i] = 1 << i
    if not merged:
        return 0
    for ident, leader in leader_of.items():
        res = model.resources.pop(ident)
        model.resources[leader].group_members.append(res)
    renamed = []
    seen: set[tuple[str, str, bool]] = set()
    for e in model.edges:
        a = leader_of.get(e.from_id, e.from_id)
        b = leader_of.get(e.to_id, e.to_id)
        if a == b or (a, b, e.notify) in seen:
            continue
        seen.add((a, b, e.notify))
        renamed.append(Edge(a, b, e.notify, e.send, e.recv, e.name))
    model.edges[:] = renamed
    return merged
