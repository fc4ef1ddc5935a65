"""A test-only resource kind that records when it runs and can be told to fail or block.

It is a real resource (same contract as the shipped kinds), not a mock: the
engine schedules it exactly like any other.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from evergraph.engine import Edge, GraphModel, Resource
from evergraph.engine.contract import Handle, Registry, register

registry = Registry()


@dataclass
class Journal:
    entries: list[tuple[str, str, float]] = field(default_factory=list)
    #: per-probe gates: check_apply waits on the event when one is set
    gates: dict[str, asyncio.Event] = field(default_factory=dict)
    started: dict[str, asyncio.Event] = field(default_factory=dict)
    handles: dict[str, Handle] = field(default_factory=dict)
    #: the stamps' clock (a FakeClock's `monotonic` for a test on virtual time)
    clock: Callable[[], float] = time.monotonic

    def add(self, name: str, what: str) -> None:
        self.entries.append((name, what, self.clock()))

    def runs(self, name: str) -> int:
        return sum(1 for n, w, _ in self.entries if n == name and w == "start")

    def stamps(self, name: str, what: str) -> list[float]:
        return [t for n, w, t in self.entries if n == name and w == what]


@register("probe", registry=registry)
class Probe(Resource, kw_only=True, dict=True, forbid_unknown_fields=True):
    fail_times: int = 0
    #: runs (1-based) that fail, on top of the first fail_times runs
    fail_runs: list[int] = []
    clean: bool = False

    async def init(self, handle: Handle) -> None:
        await super().init(handle)
        self.journal: Journal = self.journal  # set by make()
        self.journal.handles[self.name] = handle

    async def check_apply(self, apply: bool) -> bool:
        j = self.journal
        j.add(self.name, "start")
        if not apply:
            j.add(self.name, "noop")
        ev = j.started.get(self.name)
        if ev is not None:
            ev.set()
        gate = j.gates.get(self.name)
        if gate is not None:
            await gate.wait()
        else:
            await asyncio.sleep(0)
        failed = len(j.stamps(self.name, "fail"))
        if failed < self.fail_times or j.runs(self.name) in self.fail_runs:
            j.add(self.name, "fail")
            raise RuntimeError(f"planned failure {failed + 1}")
        j.add(self.name, "end")
        return self.clean


@register("eagerprobe", registry=registry)
class EagerProbe(Probe, kw_only=True, dict=True, forbid_unknown_fields=True):
    """The same, run inline by the engine (eager); it suspends on gates."""

    eager = True


@register("probe:child", registry=registry)
class ChildProbe(Probe, kw_only=True, dict=True, forbid_unknown_fields=True):
    """A sub-kind of probe, for hierarchical grouping."""


def make(
    journal: Journal, names: list[str], edges: list[tuple[str, str]], **params: dict
) -> GraphModel:  # type: ignore[type-arg]
    model = GraphModel(name="probes")
    cls = EagerProbe if params.pop("eager", False) else Probe
    for n in names:
        kw = dict(params.get(n, {}))
        res = cls(name=n, **kw)
        res.journal = journal
        model.add(res)
    for a, b in edges:
        model.connect(Edge(f"{cls.kind}[{a}]", f"{cls.kind}[{b}]"))
    model.check()
    return model
