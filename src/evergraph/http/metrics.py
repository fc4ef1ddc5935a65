"""`/metrics`: the agent in Prometheus' text format (prometheus-client renders it).

`Metrics` is a subscriber of the agent's observer hub, on the engine's hot path:
it only adds to counters and bucket counts. Everything else is read when
scraped, by a collector registered in a registry of this app's own (never the
library's global one): vertex states, the converged flag and watch events from
the engine, the World's call latencies from the agent's timed KV, the farm's
queue from `FarmQueue` (a follow of the farm's requests, when the farm runs).

A drift repair is a vertex that had settled (clean, or changed on its last
run), got a watch event and changed something again; its latency runs from
the event (the engine turns the vertex `pending` then) to the change.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from evergraph.agent.observe import Histogram
from evergraph.engine.status import VertexStatus
from evergraph.farm.model import WAITING
from evergraph.farm.service import REQS, decode_request
from evergraph.world.follow import SimpleFollower, follow
from evergraph.world.kv import KV, KeyValue

if TYPE_CHECKING:
    from evergraph.engine.engine import Engine

#: every state a vertex can be in (each is reported, 0 included)
STATES = ("pending", "running", "clean", "changed", "retrying", "failed")
#: a finished check_apply's result, by the state it left the vertex in
_RESULT = {"clean": "clean", "changed": "changed", "retrying": "failed", "failed": "failed"}


class Metrics:
    """Counts kept as statuses arrive (hot path: dict adds and a bisect)."""

    def __init__(self) -> None:
        #: (kind, result) -> finished check_apply calls
        self.applies: dict[tuple[str, str], int] = {}
        #: kind -> check_apply durations
        self.durations: dict[str, Histogram] = {}
        #: kind -> drift repairs, and their latency (event -> changed)
        self.repairs: dict[str, int] = {}
        self.repair_latency = Histogram()
        #: ident -> when its event came (engine clock), until its run ends
        self._event_at: dict[str, float] = {}

    def __call__(self, st: VertexStatus) -> None:
        state = st.state
        if state == "running":
            return
        if state == "pending":  # a settled vertex got an event
            self._event_at[st.ident] = st.since
            return
        kind = st.kind
        key = (kind, _RESULT[state])
        self.applies[key] = self.applies.get(key, 0) + 1
        h = self.durations.get(kind)
        if h is None:
            h = self.durations[kind] = Histogram()
        h.observe(st.duration)
        if state == "changed":
            at = self._event_at.pop(st.ident, None)
            if at is not None:
                self.repairs[kind] = self.repairs.get(kind, 0) + 1
                self.repair_latency.observe(st.since - at)
        elif state != "retrying":  # a retry may still repair it
            self._event_at.pop(st.ident, None)


class FarmQueue:
    """The farm's requests, followed (one watch): how many are WAITING."""

    def __init__(self, kv: KV) -> None:
        self.kv = kv
        self._states: dict[str, str] = {}

    @property
    def waiting(self) -> int:
        return sum(1 for s in self._states.values() if s == WAITING)

    def _seen(self, item: KeyValue) -> None:
        with contextlib.suppress(ValueError):  # a bad record is the matcher's to report
            self._states[item.key] = decode_request(item.value, item.key).state

    def _gone(self, item: KeyValue) -> None:
        self._states.pop(item.key, None)

    async def run(self) -> None:
        await follow(
            self.kv, REQS, SimpleFollower(on_new_updated=self._seen, on_deleted=self._gone)
        )


def _hist(name: str, doc: str, label: str, hists: dict[str, Histogram]) -> Metric:
    fam = HistogramMetricFamily(name, doc, labels=[label] if label else None)
    for value, h in sorted(hists.items()):
        buckets = [("+Inf" if b == float("inf") else repr(b), n) for b, n in h.cumulative()]
        fam.add_metric([value] if label else [], buckets, h.sum)
    return fam


class _Collector(Collector):
    def __init__(
        self,
        metrics: Metrics,
        engine: Callable[[], Engine | None],
        world: Callable[[], dict[str, Histogram]],
        farm: FarmQueue | None,
    ) -> None:
        self.metrics = metrics
        self.engine = engine
        self.world = world
        self.farm = farm

    def collect(self) -> Iterator[Metric]:
        m = self.metrics
        applies = CounterMetricFamily(
            "evergraph_check_apply",
            "Finished check_apply calls, by resource kind and result (clean, changed, failed).",
            labels=["kind", "result"],
        )
        for (kind, result), n in sorted(m.applies.items()):
            applies.add_metric([kind, result], n)
        yield applies
        yield _hist(
            "evergraph_check_apply_duration_seconds",
            "How long check_apply took, by resource kind.",
            "kind",
            m.durations,
        )
        repairs = CounterMetricFamily(
            "evergraph_drift_repairs",
            "Settled vertices that got a watch event and changed something again, by kind.",
            labels=["kind"],
        )
        for kind, n in sorted(m.repairs.items()):
            repairs.add_metric([kind], n)
        yield repairs
        yield _hist(
            "evergraph_drift_repair_latency_seconds",
            "From the watch event to the change that repaired the drift.",
            "",
            {"": m.repair_latency},
        )
        engine = self.engine()
        counts = engine.state_counts() if engine is not None else {}
        states = GaugeMetricFamily(
            "evergraph_vertices", "Vertices of the running graph, by state.", labels=["state"]
        )
        for s in STATES:
            states.add_metric([s], counts.get(s, 0))
        yield states
        events = CounterMetricFamily(
            "evergraph_watch_events", "Watch events the engine received (handle.event calls)."
        )
        events.add_metric([], engine.events if engine is not None else 0)
        yield events
        converged = engine is not None and bool(engine.graph_name) and not engine.busy()
        yield GaugeMetricFamily(
            "evergraph_converged",
            "1 when nothing runs, is queued or awaits a retry (every vertex settled).",
            value=1 if converged else 0,
        )
        yield _hist(
            "evergraph_world_operation_seconds",
            "Latency of the agent's World calls, by operation.",
            "op",
            self.world(),
        )
        if self.farm is not None:
            yield GaugeMetricFamily(
                "evergraph_farm_waiting_requests",
                "Farm requests WAITING for a worker.",
                value=self.farm.waiting,
            )


class Exposition:
    """A registry of this app's own: the collector above and the process' figures."""

    def __init__(
        self,
        metrics: Metrics,
        engine: Callable[[], Engine | None],
        world: Callable[[], dict[str, Histogram]],
        farm: FarmQueue | None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(metrics, engine, world, farm))
        ProcessCollector(registry=self.registry)

    def render(self, accept: str) -> tuple[bytes, str]:
        """The body and its content type (OpenMetrics if the scraper asks for it)."""
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type
