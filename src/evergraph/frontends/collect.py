"""Exports and collected resources, on the frontends' side: what a graph exports
(published by the agent through `cluster.exports.Publisher`), and the collected
exports (checked records from `cluster.exports.Collector`) turned into resources
of this host's graph and merged into it."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import msgspec

from evergraph.engine.contract import Registry, Resource
from evergraph.engine.model import CollectSpec, GraphModel, same_but_named
from evergraph.errors import InputError

if TYPE_CHECKING:  # the World's modules load with the agent, not for `check`
    from collections.abc import Iterable

    from evergraph.cluster.exports import Exported, ExportItem

log = logging.getLogger("evergraph.collect")


def exports_of(model: GraphModel) -> list[ExportItem]:
    """What `model` exports: one item per resource and target host (before grouping)."""
    out: list[ExportItem] = []
    for res in model.resources.values():
        targets = res.meta.export
        if not targets:
            continue
        params = msgspec.to_builtins(res)
        params.pop("meta", None)  # the collecting host decides its own meta
        for to in targets:
            out.append((to, res.kind, res.name, params))
    return out


def matching(found: list[Exported], specs: list[CollectSpec]) -> list[Exported]:
    """The exports that one of `specs` asks for."""
    return [e for e in found if any(s.matches(e.kind, e.src, e.name, e.params) for s in specs)]


class Built:
    """The collected exports built last time, by (exporter, kind, name): their
    parameters and a pristine copy of the validated resource. An export whose
    parameters are unchanged is handed out as a new copy of that resource's fields
    (~0.1 us), not built and validated again (~8 us): with 10,000 collected exports
    each change rebuilt all of them. Never the object a graph was given (prepare and
    the engine keep state on theirs); resources whose `validate` kept state of its
    own are built each time."""

    def __init__(self) -> None:
        self._by: dict[tuple[str, str, str], tuple[dict[str, Any], Resource]] = {}
        #: this round's, as `get` and `add` find or make them
        self._next: dict[tuple[str, str, str], tuple[dict[str, Any], Resource]] = {}

    def get(self, exp: Exported) -> Resource | None:
        key = (exp.src, exp.kind, exp.name)
        hit = self._by.get(key)
        if hit is None or not (hit[0] is exp.params or hit[0] == exp.params):
            return None
        self._next[key] = hit  # (kept as it is: nobody was given that copy)
        return hit[1].__copy__()  # type: ignore[attr-defined,no-any-return]

    def add(self, exp: Exported, res: Resource) -> None:
        """`res`, just built from `exp` (before anybody keeps state on it)."""
        if not res.__dict__:
            self._next[(exp.src, exp.kind, exp.name)] = (exp.params, res.__copy__())  # type: ignore[attr-defined]

    def end_round(self) -> None:
        """What this round found or built, in place of the last round's."""
        self._by, self._next = self._next, {}


def to_resources(
    registry: Registry, exports: list[Exported], cache: Built | None = None
) -> list[Resource]:
    """Collected exports as resources of this host's graph; bad ones are skipped
    with one line naming the export. `cache`: the last round's, kept for the next."""
    from evergraph.engine.build import build  # (with the first export: see yaml.py)

    got: list[Resource] = []
    for exp in exports:
        res = cache.get(exp) if cache is not None else None
        if res is None:
            where = f"{exp.kind}[{exp.name}] exported by {exp.src}"
            try:
                res = build(registry, exp.kind, {**exp.params, "name": exp.name}, where)
            except InputError as e:
                log.warning("rejected export: %s", e)
                continue
            if cache is not None:
                cache.add(exp, res)
        got.append(res)
    if cache is not None:
        cache.end_round()
    return got


def merge(model: GraphModel, collected: list[Resource]) -> GraphModel:
    """`model` plus the collected resources; a local resource wins over a collected one,
    and so does one that manages the same thing (a file path, a user…) with other
    parameters: an export must not make this host's graph fight itself, nor make it
    fail to load (another host wrote it)."""
    if not collected:
        return model
    claimed, parts = model.claimed()
    for res in collected:
        if res.ident in model.resources:
            if not model.resources[res.ident].cmp(res):
                log.warning("collected %s conflicts with a local resource: skipped", res.ident)
            continue
        whole, part = list(res.claims()), list(res.claims_part())
        clash = _clash(res, whole, part, claimed, parts)
        if clash is not None:
            key, first = clash
            log.warning(
                "collected %s manages %s, as %s does with other parameters: skipped",
                res.ident,
                key,
                first.ident,
            )
            continue
        model.add(res, origin="collected")
        for key in whole:
            claimed.setdefault(key, res)
        for key in part:
            parts.setdefault(key, res)
    return model


def _clash(
    res: Resource,
    whole: Iterable[str],
    part: Iterable[str],
    claimed: dict[str, Resource],
    parts: dict[str, Resource],
) -> tuple[str, Resource] | None:
    """What `res` (managing `whole` and `part`: its claims) would fight: a thing
    another manages whole with other parameters, or in part while `res` manages it
    whole, or whole while `res` manages a part."""
    for key in whole:
        first = claimed.get(key)
        if first is not None and not same_but_named(first, res):
            return key, first
        if key in parts:
            return key, parts[key]
    for key in part:
        if key in claimed:
            return key, claimed[key]
    return None
