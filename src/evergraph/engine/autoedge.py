"""Automatic edges: a resource that depends on another managed one runs after it.

Built from an index (provided key -> resource), so 10k files cost 10k
look-ups of a few keys each, not 10k² comparisons. An automatic edge that
would close a cycle with the user's own edges is dropped with a warning: the
user's explicit order wins.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from typing import Any

from evergraph.engine.contract import ParentDirs, Resource
from evergraph.engine.model import AutoEdges, Edge, GraphCycleError, GraphModel
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
#: per resource type: are its keys a function of its parameters (`_known_keys`)
_known: dict[type[Resource], bool] = {}
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


def _known_keys(cls: type[Resource]) -> bool:
    """Its keys are a function of its parameters: a kind of PURE_KEYS, or one with no
    keys at all (neither `autoedge_provides` nor `autoedge_wants` of its own)."""
    got = _known.get(cls)
    if got is None:
        got = _known[cls] = _keeps(cls) or (
            cls.autoedge_provides is Resource.autoedge_provides
            and cls.autoedge_wants is Resource.autoedge_wants
        )
    return got


def _namespaces(index: dict[str, str]) -> set[str]:
    """The namespaces of the provided keys (`dir` of `dir:/a/`): one split per run of
    keys that share the last one's namespace (a graph's keys come in kinds)."""
    out: set[str] = set()
    last = ""
    for key in index:
        if last and key.startswith(last):
            continue
        ns = key.partition(":")[0]
        out.add(ns)
        last = ns + ":" if ":" in key else ""
    return out


def add_autoedges(model: GraphModel) -> int:
    """Add automatic edges to `model` in place; returns how many were added."""
    global _again, _last
    known = model.auto
    model.auto = None  # (used once: what follows changes the model)
    if known is not None and known.fits(model):
        got = _add_known(model, known)
        if got is not None:
            _again, _last = True, {}  # (as a first prepare leaves them: keys found next)
            return got
    keep, _again = _again, True
    added = _find(model, keep=keep, remember=True)
    return len(added) - len(_settle(model, added, warn=True))


def automatic_edges(model: GraphModel) -> AutoEdges | None:
    """What `add_autoedges` would add to `model` (leaving it and the kept keys as they
    are), for a parse cache entry; None where that is not a function of the model
    alone: a kind whose keys may depend on the machine (not in PURE_KEYS: a package
    provides the files it installs), `collect:` (resources come later), or a cycle
    (the run reports it)."""
    if model.collect or not all(_known_keys(type(r)) for r in model.resources.values()):
        return None
    copy = GraphModel(name=model.name, resources=model.resources, edges=list(model.edges))
    try:
        added = _find(copy, keep=False, remember=False)
        dropped = _settle(copy, added, warn=False)
    except GraphCycleError:
        return None
    edges = copy.edges[len(model.edges) :]
    return AutoEdges(edges, dropped, len(model.resources), len(model.edges))


def _add_known(model: GraphModel, known: AutoEdges) -> int | None:
    """`add_autoedges` with its outcome known (a parse cache hit: `automatic_edges` of
    this very model): the edges added and the warnings given. None (nothing added)
    if they would close a cycle: not what `automatic_edges` gives (an entry is
    trusted as far as its parse, not to bring a cycle in)."""
    if known.edges:
        n = len(model.edges)
        model.edges.extend(known.edges)
        if model.forward_order() is None:
            try:
                model.order()
            except CycleError:
                del model.edges[n:]
                return None
    for drop in known.dropped:
        log.warning("dropping automatic edge %s -> %s: it closes a cycle", *drop)
    return len(known.edges)


def _find(model: GraphModel, *, keep: bool, remember: bool) -> list[Edge]:
    """The automatic edges `model` lacks. `keep`: reuse the keys the last prepared
    graph's equal resources had; `remember`: keep this graph's for the next."""
    global _last
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
    if remember:
        _last = now
    if not index:
        return []
    namespaces = _namespaces(index)
    # (by index: a NamedTuple's fields by name cost several times more)
    existing = {(e[0], e[1]) for e in model.edges}
    added: list[Edge] = []
    get = index.get
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
            keys_of: Iterator[str] | None
            first: str | None
            if type(group) is ParentDirs:  # (its first key without a generator)
                keys_of, first, ns = None, group.nearest(), "dir"
            else:
                keys_of = iter(group)
                first = next(keys_of, None)
                if first is None:
                    continue
                ns = first.partition(":")[0]
            if wanted is not None:
                wanted.append(ns)
            if ns not in namespaces:
                continue  # nothing provides this kind of key: skip the walk
            # The nearest wanted key first, without a chain: most are found at once
            # (a file's own directory), and most of those edges are explicit already
            provider = get(first)
            if provider is None or provider == ident:
                if keys_of is None:
                    keys_of = iter(group)
                    next(keys_of)  # (`first`)
                for key in keys_of:
                    provider = get(key)
                    if provider is not None and provider != ident:
                        break
                else:
                    continue
            pair = (provider, ident)
            if pair not in existing:
                existing.add(pair)
                added.append(Edge(provider, ident, name="auto"))
        if keys is not None and wanted is not None:
            got = tuple(wanted)
            keys[2] = _wants.setdefault(got, got)  # shared: most are alike
    return added


def _settle(model: GraphModel, added: list[Edge], *, warn: bool) -> list[tuple[str, str]]:
    """Add `added` to `model`, dropping those that close a cycle with the user's
    edges (one at a time, the first found on a cycle; a warning each if `warn`);
    returns the dropped, in order. A cycle of the user's own edges raises
    GraphCycleError."""
    dropped: list[tuple[str, str]] = []
    if not added:
        return dropped
    model.edges.extend(added)
    auto = {(e.from_id, e.to_id) for e in added}
    while True:
        if model.forward_order() is not None:
            break  # (no cycle: the common case, without a topological sort)
        try:
            model.order()
            break
        except CycleError as e:
            cycle = [str(v) for v in e.cycle]
            pairs = list(itertools.pairwise(cycle))
            drop = next((p for p in pairs if p in auto), None)
            if drop is None:
                raise GraphCycleError(cycle) from None
            if warn:
                log.warning("dropping automatic edge %s -> %s: it closes a cycle", *drop)
            dropped.append(drop)
            auto.discard(drop)
            model.edges[:] = [
                e for e in model.edges if not (e.name == "auto" and (e.from_id, e.to_id) == drop)
            ]
    return dropped
