"""Graph swap: replace the running graph by a new one, keeping what did not change.

A vertex whose resource compares equal (`cmp`) is kept as it is, running or
not; a changed one is replaced by a new vertex that carries the old one's
retry budget (unless meta.reset), the values it received (until its sender
sends again) and its secrets; a removed one is stopped (realized first if
meta.realize, reversed if meta.reverse). With the same edges a replaced
vertex's successor takes its place in the wiring; otherwise the graph is
rewired. New vertices are held back until their init is done, and the swap
yields to the loop every `YIELD_EVERY` vertices (a 1M graph).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from evergraph._util.atomic import atomic_write
from evergraph._util.gc import gc_paused
from evergraph.engine.contract import Resource
from evergraph.engine.model import GraphModel
from evergraph.engine.sendrecv import with_values
from evergraph.engine.state import YIELD_EVERY, EngineState, ended, yield_now
from evergraph.engine.store import Owed
from evergraph.engine.vertex import Vertex
from evergraph.graph import diff_keys

log = logging.getLogger("evergraph.engine")


class Swap(EngineState):
    async def swap(self, model: GraphModel) -> None:
        """Replace the running graph by `model`, keeping unchanged vertices as they are."""
        async with self._swap_lock:
            with gc_paused():
                await self._swap(model)

    async def _swap(self, model: GraphModel) -> None:
        # A swap is activity: the converged status drops and rises again.
        self.converger.busy()
        # resources checked (and made) ahead in a child (a one-shot run's first
        # graph): it may make them now that the graph runs (ahead.py)
        ahead = model.ahead if self.lane and self._ahead is None else None
        if ahead is not None:
            ahead.go()
        old = self.vertices
        resources = model.resources
        removed: list[str]
        added: list[str]
        if old.keys() == resources.keys():  # the common live edit: the same vertices
            removed, added, common = [], [], list(resources)
        else:
            removed, added, common = diff_keys(old, resources)
        replaced: dict[str, Vertex] = {}
        rewatch: list[Vertex] = []
        receiving: set[tuple[str, str]] | None = None
        for ident in common:
            prev = old[ident]
            if prev.received:
                # Pre-fill values received at run time, so that a receiver
                # whose declared parameters did not change is kept.
                if receiving is None:
                    receiving = {(e.to_id, e.recv) for e in model.edges if e.recv is not None}
                carried = {k: val for k, val in prev.received.items() if (ident, k) in receiving}
                prev.received = carried
                if carried:
                    resources[ident] = with_values(resources[ident], carried)
            if not prev.res.cmp(resources[ident]):
                removed.append(ident)
                added.append(ident)
                replaced[ident] = prev
            elif prev.failed and prev.res.meta.rewatch:
                rewatch.append(prev)
        if any(old[ident].res.meta.realize for ident in removed):
            removed = _parents_first(removed, old)  # a parent realizes before its children
        for ident in removed:
            gone = old.pop(ident)
            leaving = ident not in replaced
            await self._stop_vertex(gone, leaving=leaving)
            if leaving:
                self._observe(gone, "removed")  # its last status: watchers drop it
        new_vs: list[Vertex] = []
        for ident in added:
            v = Vertex(self, resources[ident], ident)
            v.watch_ready = False  # held back until started (see below)
            self._unready += 1
            before = replaced.get(ident) if replaced else None
            if before is not None:
                if not v.res.meta.reset:
                    # The retry budget is the resource's, not the vertex's: a
                    # parameter change does not buy a fresh one (unless meta.reset).
                    v.retries_left = _carry_retries(before, v)
                # values received before still hold until the sender sends again
                v.inbox = dict(before.received)
                v.secret_fields, v.secrets = before.secret_fields, before.secrets
            old[ident] = v
            new_vs.append(v)
            if len(new_vs) % YIELD_EVERY == 0:
                await yield_now()  # see YIELD_EVERY
        for v in rewatch:
            log.info("%s: failed before; restarting it (meta.rewatch)", v.ident)
            await self._stop_vertex(v, leaving=False)
            fresh = Vertex(self, v.res)
            fresh.watch_ready = False
            self._unready += 1
            fresh.secret_fields, fresh.secrets = v.secret_fields, v.secrets
            old[v.ident] = fresh
            new_vs.append(fresh)
            replaced[v.ident] = v
        rewired = not (
            model.edges == self._edges
            and all(
                gone.res.meta.hidden == old[ident].res.meta.hidden
                for ident, gone in replaced.items()
            )
        )
        if not rewired:
            # Same edges (the common live edit): hand each replaced vertex's
            # place to its successor instead of rewiring the whole graph.
            for ident, gone in replaced.items():
                _take_place(gone, old[ident])
        else:
            # every vertex new (a first graph): all are held back, so wiring may
            # yield too; with kept vertices it must not (one could run half-wired)
            await self._rewire(model, may_yield=len(new_vs) == len(old))
        self._edges = list(model.edges)
        if self.settings.graphviz is not None:
            self._write_graphviz(model)
        self._log_swap(model, len(new_vs), len(removed))
        owed = self.store.load() if not self._owed_loaded else Owed()
        self._owed_loaded = True
        for ident, record in owed.reversals.items():
            if ident not in old:
                await self._reverse(ident, record)  # left the graph while we were down
            elif not old[ident].res.meta.reverse:
                self.store.reversal_done(old[ident].res.kind, old[ident].res.name)
        refresh = owed.refresh
        # their init waits for the verdict (Vertex.ahead). Every one the child may
        # make is among them: it makes only what runs inline.
        checked: list[Resource] = []
        place: dict[int, int] | None = None
        if ahead is not None:
            self._ahead = ahead
            checked = ahead.resources
            if len(checked) != len(new_vs) or not all(
                v.res is r
                for v, r in zip(new_vs, checked, strict=True)  # (the common case)
            ):
                place = {id(r): i for i, r in enumerate(checked)}
        for i, v in enumerate(new_vs, 1):
            if refresh and v.ident in refresh:
                v.refresh_flag = True
            # New vertices were held back (not ready) so that nothing runs one
            # before its init, while this loop yields: a kept parent that succeeds
            # meanwhile pokes its children. Each is released as it starts.
            v.watch_ready = True
            self._unready -= 1
            if ahead is not None:
                at = i - 1 if place is None else place.get(id(v.res), -1)
                if at >= 0 and not v.inbox and self._takes_verdict(v.res):
                    v.ahead = at  # (a refresh owed: the lane starts it after its verdict)
            if v.ahead < 0:
                await self._start_vertex(v)
            if i % YIELD_EVERY == 0:
                await yield_now()
        # New vertices start; after a rewire, kept ones that were held back by a
        # parent that is now gone may run too. With the same edges no kept vertex
        # lost a parent (a replaced parent's successor is pending, not clean), so
        # only the new ones are poked: not a pass over all 10k on a 1 % edit.
        for i, v in enumerate(old.values() if rewired else new_vs, 1):
            if v.pending:
                ps = v.parents
                if not (ps and ps[0].pending):  # (else held back: that parent pokes it)
                    self._poke(v)
            if i % YIELD_EVERY == 0:
                await yield_now()
        self._check_idle()

    async def _rewire(self, model: GraphModel, may_yield: bool) -> None:
        """Wire every edge of `model` from scratch (yielding to the loop now and then
        if `may_yield`: no vertex may run before the wiring is done)."""
        old = self.vertices
        for v in old.values():
            v.parents.clear()
            v.children.clear()
            v.notify_children = ()
            v.send_edges = ()
        seen: set[tuple[str, str]] = set()
        notified: set[tuple[str, str]] = set()
        every = 10 * YIELD_EVERY if may_yield else 0
        # (an edge unpacked at once: its fields by name cost a call each, 10k edges)
        for i, (from_id, to_id, notify, send, recv, _name) in enumerate(model.edges, 1):
            if every and i % every == 0:
                await yield_now()
            a, b = old[from_id], old[to_id]
            pair = (from_id, to_id)
            if pair not in seen:
                seen.add(pair)
                a.children.append(b)
                b.parents.append(a)
            if send is not None and recv is not None:
                if a.send_edges:
                    a.send_edges.append((send, b, recv))
                else:
                    a.send_edges = [(send, b, recv)]
            if notify and pair not in notified and not b.res.meta.hidden:
                # a hidden vertex is never applied: no refresh is ever owed to it
                notified.add(pair)
                if a.notify_children:
                    a.notify_children.append(b)
                else:
                    a.notify_children = [b]

    def _log_swap(self, model: GraphModel, started: int, stopped: int) -> None:
        if self.loaded_said:  # (by express, which gave way: express.py)
            self.loaded_said = False
            return
        first = not self.graph_name
        self.graph_name = model.name or "(unnamed)"
        if first:
            log.info("graph %s loaded: %d vertices", self.graph_name, len(self.vertices))
        else:
            log.info(
                "graph %s swapped: %d vertices, %d started, %d stopped",
                self.graph_name,
                len(self.vertices),
                started,
                stopped,
            )

    def _write_graphviz(self, model: GraphModel) -> None:
        from evergraph.engine.render import to_dot

        path = self.settings.graphviz
        assert path is not None
        try:  # maybe in /tmp: never through a symlink planted at a temporary name
            atomic_write(path, to_dot(model).encode(), mode=0o644, dir_mode=0o755)
        except OSError as e:
            log.error("cannot write the graphviz file %s: %s", path, e)

    async def _stop_vertex(self, v: Vertex, leaving: bool = True) -> None:
        """Stop a vertex; `leaving`: its resource leaves the graph (not merely replaced)."""
        self._unsubscribe(v)
        repair = self._repairs.pop(v, None)
        if repair is not None:
            repair.cancel()
        if v.watch_task is not None:
            v.watch_task.cancel()
            await ended(v.watch_task)
        if v.apply_task is not None:
            # The old graph's work in flight is allowed to finish.
            await ended(v.apply_task)
        if not v.watch_ready:
            v.watch_ready = True
            self._unready -= 1
        if leaving and v.res.meta.realize and not v.ever_ok and not v.failed:
            await self._realize(v)
        await self._call_cleanup(v)
        if leaving and v.res.meta.reverse:
            record = self.store.load_reversal(v.res.kind, v.res.name)
            if record is not None:
                await self._reverse(v.ident, record)

    async def _realize(self, v: Vertex) -> None:
        """meta.realize: one successful apply before the resource may leave. Like any
        run, it waits for its parents to succeed, and in noop it only checks."""
        stuck = await self._parents_settled(v)
        if stuck is not None:
            log.error(
                "%s: left the graph unrealized: its parent %s has not succeeded",
                v.ident,
                stuck.ident,
            )
            return
        apply = not (self.settings.noop or v.res.meta.noop)
        log.info(
            "%s: leaving the graph before it was ever applied: %s once",
            v.ident,
            "applying" if apply else "checking (noop)",
        )
        try:
            clean = await self._guarded_check_apply(v, v.res, apply)
            v.reported = None
            v.ok = v.ever_ok = True
            v.pending = False
            if not clean:
                log.info("%s: %s", v.ident, "applied" if apply else "would change (noop)")
        except Exception as e:
            log.error("%s: could not be realized before removal: %s", v.ident, v.mask(str(e)))

    async def _parents_settled(self, v: Vertex) -> Vertex | None:
        """Wait until every parent of `v` is clean: None then. Else the ancestor that
        will not succeed by itself (failed, retrying, or gone from the graph)."""
        while not all(p.clean for p in v.parents):
            stuck = self._stuck_ancestor(v)
            if stuck is not None:
                return stuck
            waiter = asyncio.get_running_loop().create_future()
            self._progress.append(waiter)
            await waiter
        return None

    def _stuck_ancestor(self, v: Vertex) -> Vertex | None:
        """An ancestor holding `v` back that will not succeed by itself; None while each
        one that is not clean is running or due to run."""
        seen: set[int] = set()
        todo = [p for p in v.parents if not p.clean]
        while todo:
            p = todo.pop()
            if id(p) in seen or p.clean:
                continue
            seen.add(id(p))
            if (
                p.failed
                or p.retry_wait
                or not (p.pending or p.running)
                or self.vertices.get(p.ident) is not p
            ):
                return p
            if not p.running:
                todo.extend(q for q in p.parents if not q.clean)  # held back by these
        return None

    async def _follow(self, updates: AsyncIterator[GraphModel]) -> None:
        async for model in updates:
            await self.swap(model)


def _parents_first(idents: list[str], vertices: dict[str, Vertex]) -> list[str]:
    """`idents` ordered so that each comes after those of its parents among them."""
    among = set(idents)
    done: set[str] = set()
    out: list[str] = []
    for root in idents:
        stack = [(root, False)]
        while stack:
            ident, expanded = stack.pop()
            if expanded:
                out.append(ident)
                continue
            if ident in done:
                continue
            done.add(ident)
            stack.append((ident, True))
            stack.extend(
                (p.ident, False)
                for p in vertices[ident].parents
                if p.ident in among and p.ident not in done
            )
    return out


def _carry_retries(prev: Vertex, new: Vertex) -> int:
    """Retries left for a replaced vertex: the old budget's use, against the new budget."""
    budget = new.res.meta.retry
    if budget < 0 or prev.res.meta.retry < 0:
        return budget
    used = max(0, prev.res.meta.retry - prev.retries_left)
    return max(0, budget - used)


def _take_place(gone: Vertex, new: Vertex) -> None:
    """Give `new` the edges of the vertex it replaces, in both directions."""
    new.parents, new.children = gone.parents, gone.children
    new.notify_children, new.send_edges = gone.notify_children, gone.send_edges
    gone.parents, gone.children, gone.notify_children, gone.send_edges = [], [], (), ()
    for p in new.parents:
        p.children[p.children.index(gone)] = new
        kids = p.notify_children
        if isinstance(kids, list) and gone in kids:
            kids[kids.index(gone)] = new
        if p.send_edges:
            p.send_edges = [(s, new if c is gone else c, r) for s, c, r in p.send_edges]
    for c in new.children:
        c.parents[c.parents.index(gone)] = new
