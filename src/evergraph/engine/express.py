"""Express: a one-shot run whose first graph the children ahead decided whole, or
all but a small part of it, ends with no vertex built for what they decided.

The lane (scheduling.py) takes a verdict from the work run ahead (ahead.py) for
each vertex: CREATED is recorded changed, CLEAN clean, with no init and no
check. When every resource of the graph gets such a verdict, all that is left
of the engine's work is bookkeeping: 10k vertices built, wired, queued, each
verdict recorded on one, at ~20 us a vertex in the parent while the children
make the files (on two cores the three processes share them), then the recap
read back off the vertices. `Express._express` does the same bookkeeping on the
verdicts themselves: the same log line for each change (held and logged in
batches, as the lane logs a change a child made), the same "loaded",
"converged" and recap lines, the converged-status file, exit status 0. Each
change's status and line are made as its verdict comes (the parent has little
else to do while the children make), and logged once all came; what a made
resource changed is asked of the first of each `Resource.ahead_alike` key alone
(10k files made alike: a few keys, `_Changes`).

It is taken only where the lane would have taken every verdict and done nothing else
(`_may_express`): the engine's first graph in a one-shot run, no observer (the live
display, HTTP), no graphviz file, no global semaphore; every resource one whose kind
tells ahead, that runs inline, is neither hidden nor grouped, has no cleanup; no
debug log (its line per vertex); no edge but orders; the store owes no refresh and
no reversal.

A few verdicts OTHER (a file drifted: there, not in its state) leave the rest to
the lane (`_rest`): those resources and everything below them, no more than a part
of the graph (`REST_PART`), run as the lane runs them, in a graph of their own (the
swap of that part: their vertices, the edges among them, their verdicts taken as
the lane takes them). Everything above them was decided by the children and is
final (found so or made, and committed), so an edge from it into the part orders
nothing any more; nothing in the part is above anything outside it. The recap and
the converged line count both (`_recap_parts`).

It gives way to the usual run (`swap`, the lane) the moment it cannot finish so: more
verdicts OTHER than a part, a child that ended without a verdict for all, a CLEAN
resource below a CREATED one (the lane checks it again), or a stop. Nothing is lost
then: the verdicts taken so far are the lane's as they were, and no line was logged.
A change is counted and its line held only once every verdict came and none of these
hold, so the lane never sees a CREATED verdict taken (`Ahead.take`) by this path.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Hashable
from functools import partial
from operator import is_
from typing import cast

from evergraph._util.crash import crash_point
from evergraph._util.gc import gc_paused
from evergraph.engine import changes
from evergraph.engine.ahead import CLEAN, CREATED, OTHER, PENDING, Ahead
from evergraph.engine.contract import Handle, Resource
from evergraph.engine.model import GraphModel
from evergraph.engine.outcomes import change_entry
from evergraph.engine.state import EngineState
from evergraph.engine.status import Change, VertexStatus
from evergraph.engine.stop import GRACEFUL

log = logging.getLogger("evergraph.engine")

#: reports kept with what they changed, at most (`_all_told`)
ALIKE_MAX = 1024
#: change lines logged together (`changes.log_batch`), as the lane's batches
LOG_BATCH = 1024
#: the resources left to the lane (verdicts OTHER and all below them) are at most
#: this part of the graph (1/4): more, and the whole graph is the lane's at once
#: (its checks start while the children still work)
REST_PART = 4


class Expressed:
    """What an express run did, for the converged line and the recap: how many
    resources, and a status for each one made (the clean ones are counted)."""

    __slots__ = ("clean", "made", "total")

    def __init__(self, total: int, made: list[VertexStatus]) -> None:
        self.total = total
        self.made = made
        self.clean = total - len(made)


class _Reports:
    """The `Handle` a kind's `ahead_created` reports through (`changed` only, which
    is all it may call: see `Resource.ahead_created`)."""

    __slots__ = ("reported",)

    def __init__(self) -> None:
        self.reported: list[tuple[str, object, object, bool]] = []

    def changed(self, field: str, old: object, new: object, *, content: bool = False) -> None:
        self.reported.append((field, old, new, content))


def _identity(text: str) -> str:
    return text


class _Changes:
    """What each resource made ahead changed (`Resource.ahead_created`), as the lane
    records it. What was made alike changed alike (10k files: a few sizes, one mode):
    one `Change` tuple per shape of reports, and with no diffs (a content by its size
    alone) per key the kind gives (`ahead_alike`), which spares its reports."""

    __slots__ = ("alike", "diffs", "hashable", "keyed")

    def __init__(self, diffs: bool) -> None:
        self.diffs = diffs
        #: by shape of reports (`changes.shape`)
        self.alike: dict[tuple[object, ...], tuple[Change, ...]] = {}
        #: by kind and `ahead_alike` key
        self.keyed: dict[tuple[type[Resource], Hashable], tuple[Change, ...]] = {}
        self.hashable = True

    def of(self, res: Resource) -> tuple[Change, ...] | None:
        """`res`'s changes; None if its kind cannot report them (the lane records that)."""
        known = None
        if not self.diffs:
            try:
                key = res.ahead_alike()
                if key is not None:
                    known = (type(res), key)
                    done = self.keyed.get(known)
                    if done is not None:
                        return done
            except Exception:  # (cannot be hashed, or its kind's fault: asked of it)
                known = None
        reports = _Reports()
        try:
            res.ahead_created(cast(Handle, reports))
            shape = changes.shape(reports.reported, self.diffs)
        except Exception:
            return None
        try:
            done = self.alike.get(shape)
        except TypeError:  # (a value that cannot be hashed)
            done, self.hashable = None, False
        if done is None:
            try:
                done = changes.build(reports.reported, (), _identity, self.diffs)
            except Exception:
                return None
            if self.hashable and len(self.alike) < ALIKE_MAX:
                self.alike[shape] = done
        if known is not None and len(self.keyed) < ALIKE_MAX:
            self.keyed[known] = done
        return done


def _settle(came: asyncio.Future[None]) -> None:
    if not came.done():
        came.set_result(None)


class Express(EngineState):
    #: whether a first graph decided whole ahead may end without vertices (tests
    #: turn it off to compare with the lane)
    express = True
    #: set by an express run (`_express`)
    expressed: Expressed | None = None

    def _may_express(self, model: GraphModel, ahead: Ahead) -> bool:
        """Whether the lane would take a verdict for every resource of `model` and
        do nothing else with it (see the module's docstring; what the store owes is
        read after the go)."""
        if not (
            self.express
            and self.one_shot
            and not self.vertices
            and self.observer is None
            and self.settings.graphviz is None
            and not log.isEnabledFor(logging.DEBUG)  # (-v: a line per vertex, see _observe)
            and len(ahead.resources) == len(model.resources)
            and all(map(is_, ahead.resources, model.resources.values()))
        ):
            return False
        no_cleanup = Resource.cleanup
        #: by kind and meta (a graph's resources share a few metas): no cleanup, and
        #: the lane takes its verdicts but for a group (`_takes_verdict`)
        takes: dict[tuple[type[Resource], int], bool] = {}
        for res in ahead.resources:  # (a kind that cannot tell: no verdict will come)
            cls = type(res)
            key = (cls, id(res.meta))  # (each resource holds its meta: ids stay)
            ok = takes.get(key)
            if ok is None:
                ok = takes[key] = cls.cleanup is no_cleanup and self._takes_verdict(res)
            if not ok or getattr(res, "_group_members", None):
                return False
        return not any(e.notify or e.send is not None or e.recv is not None for e in model.edges)

    async def _express(self, model: GraphModel) -> bool:
        """Run `model`, the first graph, on its verdicts ahead alone, if it may be
        (True: done, converged; False: nothing done but the go, `swap` runs it)."""
        ahead = model.ahead
        if ahead is None or not self.lane:
            return False
        # the go first, as the swap gives it: the children make while this asks
        # (10k resources) whether it may go on
        self.converger.busy()
        ahead.go()
        if not self._may_express(model, ahead):
            return False
        owed = self.store.load()  # (after the go: swap loads it again if this gives way)
        if owed.refresh or owed.reversals:
            return False
        n = len(ahead.resources)
        self.graph_name = model.name or "(unnamed)"
        log.info("graph %s loaded: %d vertices", self.graph_name, n)
        self.loaded_said = True  # (not again by the swap if this gives way)
        #: per place: what a CREATED one changed, its status and its line, made as
        #: its verdict comes (while the children make the rest)
        made: list[tuple[VertexStatus, changes.Entry] | None] = [None] * n
        #: the places of the verdicts OTHER (as they come)
        others: list[int] = []
        with gc_paused():  # (10k statuses and lines: nothing for the collector)
            if not await self._all_told(ahead, made, others, n // REST_PART):
                return False
            if not self._upstream_clean(model, ahead):
                return False
            rest = self._rest(model, others) if others else []
            if len(rest) > n // REST_PART or any(made[i] is not None for i in rest):
                return False  # (the lane's whole: see REST_PART; nothing made is below one)
        # done: from here on, as the lane would have recorded them
        statuses: list[VertexStatus] = []
        entries: list[changes.Entry] = []
        for i, one in enumerate(made):
            if one is not None:
                ahead.take(i)  # (TAKEN: its change is logged here)
                statuses.append(one[0])
                entries.append(one[1])
                crash_point("parent-changed")  # (its line held, as the lane holds it)
        for start in range(0, len(entries), LOG_BATCH):
            changes.log_batch(log, entries[start : start + LOG_BATCH], event="changed")
        self.ahead_made = len(statuses)
        self.ahead_runs = n - len(statuses) - len(rest)
        self.expressed = Expressed(n - len(rest), statuses)
        if not rest:
            self._ahead = ahead
            return True
        # the rest: the lane's, in a graph of its own (the swap takes its verdicts:
        # the clean ones below one that changes are checked again, as in the whole)
        idents = list(model.resources)
        part = {idents[i]: model.resources[idents[i]] for i in rest}
        edges = [e for e in model.edges if e.from_id in part and e.to_id in part]
        await self.swap(GraphModel(name=model.name, resources=part, edges=edges, ahead=ahead))
        return True

    @staticmethod
    def _rest(model: GraphModel, others: list[int]) -> list[int]:
        """The places of `others` and of every resource below one of them, in the
        graph's order."""
        place = {ident: i for i, ident in enumerate(model.resources)}
        below: dict[int, list[int]] = {}
        for e in model.edges:
            below.setdefault(place[e.from_id], []).append(place[e.to_id])
        marked = set(others)
        stack = list(others)
        while stack:
            for b in below.get(stack.pop(), ()):
                if b not in marked:
                    marked.add(b)
                    stack.append(b)
        return sorted(marked)

    async def _all_told(
        self,
        ahead: Ahead,
        made: list[tuple[VertexStatus, changes.Entry] | None],
        others: list[int],
        most: int,
    ) -> bool:
        """Wait until every verdict came, making each CREATED one's record in `made`
        as it comes and noting each OTHER one's place in `others`: True once all
        came; False at the OTHER one past `most`, a child's end without them, a kind
        that cannot report what it made (the lane records that failure), or a
        stop."""
        loop = asyncio.get_running_loop()
        stopped = asyncio.ensure_future(self.stop.wait(GRACEFUL))
        resources, verdicts = ahead.resources, ahead.verdicts
        diffs = self.settings.diff
        clock = self.clock
        # (those come already first: a child may have told some before the go)
        fresh = ahead.fresh = [i for i, verdict in enumerate(verdicts) if verdict != PENDING]
        changed = _Changes(diffs).of
        try:
            while True:
                ahead.poll()
                if fresh:
                    now, wall = clock.monotonic(), clock.time()
                    for i in fresh:
                        verdict = verdicts[i]
                        if verdict == OTHER:
                            others.append(i)  # (the lane checks it)
                            if len(others) > most:
                                return False
                            continue
                        if verdict != CREATED:
                            continue
                        res = resources[i]
                        done = changed(res)
                        if done is None:
                            return False
                        ident = res.ident
                        status = VertexStatus(
                            ident, res.kind, res.name, "changed", now, None, 1, 0, 0, 0.0, wall,
                            done,
                        )  # fmt: skip
                        made[i] = (status, change_entry(ident, "applied", done, diffs))
                    fresh.clear()
                if PENDING not in verdicts:
                    return True
                if ahead.ended or stopped.done():  # (a child ended without a verdict)
                    return False
                came: asyncio.Future[None] = loop.create_future()
                ahead.wake(partial(_settle, came))
                await asyncio.wait((came, stopped), return_when=asyncio.FIRST_COMPLETED)
        finally:
            ahead.fresh = None
            stopped.cancel()
            ahead.quiet()

    def _upstream_clean(self, model: GraphModel, ahead: Ahead) -> bool:
        """No CLEAN verdict below a CREATED one (the lane would check it again: what
        it depends on changed in this run)."""
        verdicts = ahead.verdicts
        if CREATED not in verdicts or CLEAN not in verdicts:
            return True
        place = {ident: i for i, ident in enumerate(model.resources)}
        for e in model.edges:
            if verdicts[place[e.from_id]] == CREATED and verdicts[place[e.to_id]] == CLEAN:
                return False
        return True
