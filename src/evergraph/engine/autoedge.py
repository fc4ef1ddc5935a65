"""Automatic edges: a resource that depends on another managed one runs after it.

Built from an index (provided key -> resource), so 10k files cost 10k
look-ups of a few keys each, not 10k² comparisons. An automatic edge that
would close a cycle with the user's own edges is dropped with a warning: the
user's explicit order wins.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

from evergraph.engine.contract import Resource
from evergraph.engine.model import Edge, GraphCycleError, GraphModel
from evergraph.graph import CycleError

log = logging.getLogger("evergraph.autoedge")


#: built-in kinds whose keys are a function of their parameters alone (not pkg:
#: it provides its installed files): their keys are kept from one prepare to the
#: next for an equal resource (a live edit of a 10k graph changes a few)
PURE_KEYS = frozenset(
    {
        "file", "line", "exec", "svc", "user", "group", "sysctl", "ssh_authorized_key",
        "password", "augeas", "mount", "tar", "gzip",
    }
)  # fmt: skip
_RESOURCES_PACKAGE = "evergraph.resources."


#: the last prepared graph's keys, by identity (kinds of PURE_KEYS only): a
#: copy of the resource as it was then (fields only: never the one the engine
#: runs, whose fields may have received values since), its provided keys, and
#: the namespaces its wants use (None until walked)
_last: dict[str, list[Any]] = {}
#: per resource type: are its keys kept (a built-in kind of PURE_KEYS)
_pure: dict[type[Resource], bool] = {}
#: the namespaces resources want, shared (`("dir", "pkgfile")` for every file)
_wants: dict[tuple[str, ...], tuple[str, ...]] = {}
#: keys are kept from the second prepare of a process on: a one-shot run
#: prepares once and would only pay for the copies (~1 us a resource)
_again = False


def _keeps(cls: type[Resource]) -> bool:
    got = _pure.get(cls)
    if got is None:
        got = _pure[cls] = cls.kind in PURE_KEYS and cls.__module__.startswith(_RESOURCES_PACKAGE)
    return got


def add_autoedges(model: GraphModel) -> int:
    """Add automatic edges to `model` in place; returns how many were added."""
    global _last, _again
    keep, _again = _again, True
    last: dict[str, list[Any]] = _last
    now: dict[str, list[Any]] = {}
    index: dict[str, str] = {}
    cls: type[Resource] | None = None
    keeps = False
    for ident, res in model.resources.items():
        if not res.meta.autoedge:
            continue
        if keep and type(res) is not cls:
            cls = type(res)
            keeps = _keeps(cls)
        if keeps:
            keys = last.get(ident)
            if keys is None or keys[0] != res:
                keys = [res.__copy__(), res.autoedge_provides(), None]  # type: ignore[attr-defined]
            now[ident] = keys
            provides: list[str] = keys[1]
        else:
            provides = res.autoedge_provides()
        for key in provides:
            index.setdefault(key, ident)
    _last = now
    if not index:
        return 0
    namespaces = {key.partition(":")[0] for key in index}
    existing = {(e.from_id, e.to_id) for e in model.edges}
    added: list[Edge] = []
    for ident, res in model.resources.items():
        if not res.meta.autoedge:
            continue
        might = res.wants_namespaces
        if might is not None and might.isdisjoint(namespaces):
            continue  # its kind wants nothing of what this graph provides
        wanted: list[str] | None = None
        keys = now.get(ident) if now else None
        if keys is not None:
            if (was := keys[2]) is not None:
                for ns in was:
                    if ns in namespaces:
                        break
                else:
                    continue  # nothing provides what it wants
            wanted = []
        for group in res.autoedge_wants():
            keys_of = iter(group)
            first = next(keys_of, None)
            if first is None:
                continue
            ns = first.partition(":")[0]
            if wanted is not None:
                wanted.append(ns)
            if ns not in namespaces:
                continue  # nothing provides this kind of key: skip the walk
            for key in itertools.chain((first,), keys_of):
                provider = index.get(key)
                if provider is None or provider == ident:
                    continue
                if (provider, ident) not in existing:
                    existing.add((provider, ident))
                    added.append(Edge(provider, ident, name="auto"))
                break
        if keys is not None and wanted is not None:
            got = tuple(wanted)
            keys[2] = _wants.setdefault(got, got)  # shared: most are alike
    if not added:
        return 0
    model.edges.extend(added)
    auto = {(e.from_id, e.to_id) for e in added}
    while True:
        try:
            model.order()
            break
        except CycleError as e:
            cycle = [str(v) for v in e.cycle]
            pairs = list(itertools.pairwise(cycle))
            drop = next((p for p in pairs if p in auto), None)
            if drop is None:
                raise GraphCycleError(cycle) from None
            log.warning("dropping automatic edge %s -> %s: it closes a cycle", *drop)
            auto.discard(drop)
            model.edges[:] = [
                e for e in model.edges if not (e.name == "auto" and (e.from_id, e.to_id) == drop)
            ]
    return len(auto)
