"""`/metrics`: the agent in Prometheus' text format (prometheus-client renders it).

`Metrics` is a subscriber of the agent's observer hub, on the engine's hot path:
it only adds to counters and bucket counts. Everything else is read when
scraped, by a collector registered in a registry of this app's own (never the
library's global one): vertex states, the converged flag and watch events from
the engine, the World's call latencies from the agent's timed KV, the farm's
queue from `FarmQueue` (a follow of the farm's requests, when the farm runs),
the self-forming cluster's members and changes from a callable the agent
hands in (`ClusterFigures`, only with `--etcd embedded`).

The event loop's stalls are watched too (`watch_loop`): a timer every 25 ms
notes how late it ran while the loop's own thread was busy (its CPU time moved:
lateness from a machine that did not schedule the agent is no stall of ours).

A drift repair is a vertex that had settled (clean, or changed on its last
run), got a watch event and changed something again; its latency runs from
the event (the engine turns the vertex `pending` then) to the change.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from evergraph.agent.observe import ClusterFigures, Histogram
from evergraph.engine.status import GraphQuery, VertexStatus, vertex_count
from evergraph.farm.model import WAITING
from evergraph.farm.service import REQS, open_request
from evergraph.farm.signed import FarmTrust
from evergraph.world.follow import SimpleFollower, follow
from evergraph.world.kv import KV, KeyValue

#: every state a vertex can be in (each is reported, 0 included)
STATES = ("pending", "running", "clean", "changed", "retrying", "failed", "unknown")
#: a finished check_apply's result, by the state it left the vertex in
_RESULT = {
    "clean": "clean",
    "changed": "changed",
    "retrying": "failed",
    "failed": "failed",
    "unknown": "unknown",
}


#: the loop-stall histogram's buckets (seconds)
STALL_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
#: how often `watch_loop` looks
STALL_TICK = 0.025


async def watch_loop(metrics: Metrics) -> None:
    """Record each event-loop stall of 10 ms or more: a tick that ran late while the
    loop's thread spent that lateness on the CPU (our code held the loop)."""
    loop = asyncio.get_running_loop()
    while True:
        began, cpu = loop.time(), time.thread_time()
        await asyncio.sleep(STALL_TICK)
        late = loop.time() - began - STALL_TICK
        busy = time.thread_time() - cpu
        stall = min(late, busy)
        if stall >= 0.01:
            metrics.stalls.observe(stall)
            if stall > metrics.stall_max:
                metrics.stall_max = stall


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
        #: statuses seen, runs finished, repairs: versions of what is rendered
        self.seen = 0
        self.finished = 0
        self.repaired = 0
        #: the event loop's stalls (see `watch_loop`), and the longest
        self.stalls = Histogram(STALL_BUCKETS)
        self.stall_max = 0.0

    def __call__(self, st: VertexStatus) -> None:
        self.seen += 1
        state = st.state
        if state == "running":
            return
        if state == "pending":  # a settled vertex got an event
            self._event_at[st.ident] = st.since
            return
        if state == "removed":  # left the graph: no run, and no repair to wait for
            self._event_at.pop(st.ident, None)
            return
        self.finished += 1
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
                self.repaired += 1
                self.repairs[kind] = self.repairs.get(kind, 0) + 1
                self.repair_latency.observe(st.since - at)
        elif state != "retrying" and self._event_at:  # a retry may still repair it
            self._event_at.pop(st.ident, None)


class FarmQueue:
    """The farm's requests, followed (one watch): how many are WAITING."""

    def __init__(self, kv: KV, trust: FarmTrust) -> None:
        self.kv = kv
        self.trust = trust
        self._states: dict[str, str] = {}

    @property
    def waiting(self) -> int:
        return sum(1 for s in self._states.values() if s == WAITING)

    def _seen(self, item: KeyValue) -> None:
        try:
            self._states[item.key] = open_request(self.trust, item)[0].state
        except ValueError:  # untrusted: not counted (the matcher reports it)
            self._states.pop(item.key, None)

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


class _One(Collector):
    """A registry of one metric family (rendered alone, then cached)."""

    def __init__(self, metric: Metric) -> None:
        self.metric = metric

    def collect(self) -> Iterator[Metric]:
        yield self.metric


#: a family: the version it is at now (unchanged: its text is reused) and its builder
_Family = tuple[Callable[[], object], Callable[[], Metric]]


class _Collector(Collector):
    """Every evergraph family. Rendering is most of a scrape's cost (~12 us a line,
    in the agent's loop): each family is rendered again only when its version moved."""

    def __init__(
        self,
        metrics: Metrics,
        engine: Callable[[], GraphQuery | None],
        world: Callable[[], dict[str, Histogram]],
        farm: FarmQueue | None,
        cluster: Callable[[], ClusterFigures | None] | None = None,
    ) -> None:
        self.metrics = metrics
        self.engine = engine
        self.world = world
        self.farm = farm
        self.cluster = cluster
        self._counts: tuple[object, Mapping[str, int]] = ((), {})
        m = metrics
        self.families: list[_Family] = [
            (lambda: m.finished, self._applies),
            (lambda: m.finished, self._durations),
            (lambda: m.repaired, self._repairs),
            (lambda: m.repaired, self._repair_latency),
            (self._states_version, self._states),
            (self._events_version, self._events),
            (self._converged_version, self._converged),
            (self._world_version, self._world),
            (lambda: m.stalls.count, self._stalls),
        ]
        if farm is not None:
            self.families.append((lambda: farm.waiting, self._farm))
        if cluster is not None:
            self.families += [
                (cluster, self._voters),
                (cluster, self._learners),
                (cluster, self._standbys),
                (cluster, self._leader_changes),
                (cluster, self._replacements),
            ]

    def collect(self) -> Iterator[Metric]:
        for _, build in self.families:
            yield build()

    def _stalls(self) -> Metric:
        return _hist(
            "evergraph_event_loop_stall_seconds",
            "Stalls of the agent's event loop (10 ms or more while its thread was busy): "
            "time in which it answered no client, lease or watch.",
            "",
            {"": self.metrics.stalls},
        )

    def _applies(self) -> Metric:
        fam = CounterMetricFamily(
            "evergraph_check_apply",
            "Finished check_apply calls, by resource kind and result (clean, changed, failed, "
            "unknown: a noop run that could not tell).",
            labels=["kind", "result"],
        )
        for (kind, result), n in sorted(self.metrics.applies.items()):
            fam.add_metric([kind, result], n)
        return fam

    def _durations(self) -> Metric:
        return _hist(
            "evergraph_check_apply_duration_seconds",
            "How long check_apply took, by resource kind.",
            "kind",
            self.metrics.durations,
        )

    def _repairs(self) -> Metric:
        fam = CounterMetricFamily(
            "evergraph_drift_repairs",
            "Settled vertices that got a watch event and changed something again, by kind.",
            labels=["kind"],
        )
        for kind, n in sorted(self.metrics.repairs.items()):
            fam.add_metric([kind], n)
        return fam

    def _repair_latency(self) -> Metric:
        return _hist(
            "evergraph_drift_repair_latency_seconds",
            "From the watch event to the change that repaired the drift.",
            "",
            {"": self.metrics.repair_latency},
        )

    def _states_version(self) -> object:
        # a swap adds vertices (they run: seen) or removes some (the count moves)
        engine = self.engine()
        return (self.metrics.seen, vertex_count(engine) if engine is not None else -1)

    def _states(self) -> Metric:
        version = self._states_version()
        if self._counts[0] != version:  # counting 10k vertices takes ~1 ms
            engine = self.engine()
            self._counts = (version, engine.state_counts() if engine is not None else {})
        counts = self._counts[1]
        fam = GaugeMetricFamily(
            "evergraph_vertices", "Vertices of the running graph, by state.", labels=["state"]
        )
        for s in STATES:
            fam.add_metric([s], counts.get(s, 0))
        return fam

    def _events_version(self) -> int:
        engine = self.engine()
        return engine.events if engine is not None else 0

    def _events(self) -> Metric:
        fam = CounterMetricFamily(
            "evergraph_watch_events", "Watch events the engine received (handle.event calls)."
        )
        fam.add_metric([], self._events_version())
        return fam

    def _converged_version(self) -> object:
        engine = self.engine()
        return engine is not None and bool(engine.graph_name) and not engine.busy()

    def _converged(self) -> Metric:
        return GaugeMetricFamily(
            "evergraph_converged",
            "1 when nothing runs, is queued or awaits a retry (every vertex settled).",
            value=1 if self._converged_version() else 0,
        )

    def _world_version(self) -> object:
        return sum(h.count for h in self.world().values())

    def _world(self) -> Metric:
        return _hist(
            "evergraph_world_operation_seconds",
            "Latency of the agent's World calls, by operation.",
            "op",
            self.world(),
        )

    def _farm(self) -> Metric:
        assert self.farm is not None
        return GaugeMetricFamily(
            "evergraph_farm_waiting_requests",
            "Farm requests WAITING for a worker.",
            value=self.farm.waiting,
        )

    def _figures(self) -> ClusterFigures:
        assert self.cluster is not None
        return self.cluster() or ClusterFigures(0, 0, 0, 0, 0)

    def _voters(self) -> Metric:
        return GaugeMetricFamily(
            "evergraph_cluster_voters",
            "Voting members of the etcd cluster, as this agent's seat last saw them.",
            value=self._figures().voters,
        )

    def _learners(self) -> Metric:
        return GaugeMetricFamily(
            "evergraph_cluster_learners",
            "Learners of the etcd cluster (added, not yet promoted): 0 or 1.",
            value=self._figures().learners,
        )

    def _standbys(self) -> Metric:
        return GaugeMetricFamily(
            "evergraph_cluster_standbys",
            "Agents run with --etcd embedded that hold no member (ready to be added).",
            value=self._figures().standbys,
        )

    def _leader_changes(self) -> Metric:
        fam = CounterMetricFamily(
            "evergraph_cluster_leader_changes",
            "Times this agent saw the etcd leader change to another member.",
        )
        fam.add_metric([], self._figures().leader_changes)
        return fam

    def _replacements(self) -> Metric:
        fam = CounterMetricFamily(
            "evergraph_cluster_member_replacements",
            "Dead voters this agent removed as curator, for a standby to take their seat.",
        )
        fam.add_metric([], self._figures().replacements)
        return fam


class Exposition:
    """This app's own registries (never the library's global one): the evergraph
    families, rendered one by one with a cache, and the process' figures.

    A body is rendered at most every `fresh` seconds (per format); scrapes in
    between get the last one. Rendering runs in the engine's loop (~2 ms after
    changes on a 10k graph), so a scraper polling every 100 ms would otherwise
    delay drift repairs that land meanwhile; Prometheus scrapes every 15 s."""

    def __init__(
        self,
        metrics: Metrics,
        engine: Callable[[], GraphQuery | None],
        world: Callable[[], dict[str, Histogram]],
        farm: FarmQueue | None,
        fresh: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        cluster: Callable[[], ClusterFigures | None] | None = None,
    ) -> None:
        self.fresh = fresh
        self.clock = clock
        self.collector = _Collector(metrics, engine, world, farm, cluster)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        self.process = CollectorRegistry(auto_describe=False)
        ProcessCollector(registry=self.process)
        #: (content type, family index) -> (version, text)
        self._cache: dict[tuple[str, int], tuple[object, bytes]] = {}
        #: content type -> (when rendered, body)
        self._bodies: dict[str, tuple[float, bytes]] = {}

    def render(self, accept: str) -> tuple[bytes, str]:
        """The body and its content type (OpenMetrics if the scraper asks for it)."""
        encoder, content_type = choose_encoder(accept)
        now = self.clock()
        last = self._bodies.get(content_type)
        if last is not None and now - last[0] < self.fresh:
            return last[1], content_type
        parts = []
        for i, (version, build) in enumerate(self.collector.families):
            v = version()
            hit = self._cache.get((content_type, i))
            if hit is None or hit[0] != v:
                hit = self._cache[(content_type, i)] = (v, _strip_eof(encoder(_One(build()))))
            parts.append(hit[1])
        parts.append(encoder(self.process))  # ends with OpenMetrics' "# EOF", if any
        body = b"".join(parts)
        self._bodies[content_type] = (now, body)
        return body, content_type


def _strip_eof(text: bytes) -> bytes:
    return text.removesuffix(b"# EOF\n")
