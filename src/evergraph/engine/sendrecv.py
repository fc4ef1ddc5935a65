"""Send/recv: values a resource sends along its edges to another's parameters.

After a sender's successful run, each value it sends (`sent()`) that differs
from what the receiver has goes to the receiver's inbox and makes it pending;
secrets (marked by the sender, or a secret the sender itself received) are
marked on the receiver before it ever sees the value, and masked in every text
about it. The receiver's next run first takes its inbox: a new resource with
the values (checked against the declared types), validated, re-initialised.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import msgspec

from evergraph.engine.contract import Resource
from evergraph.engine.state import EngineState, ended
from evergraph.engine.vertex import NO_VALUES, Vertex
from evergraph.errors import InputError

log = logging.getLogger("evergraph.engine")


class SendRecv(EngineState):
    async def _receive(self, v: Vertex) -> Resource:
        """Apply received values: a new resource with them, validated, re-initialised."""
        values, v.inbox = v.inbox, NO_VALUES
        new = with_values(v.res, _as_declared(v.res, values))
        new.meta.check(new.ident)
        new.validate()  # an InputError here is this vertex's failure
        self._unsubscribe(v)
        if v.watch_task is not None:
            v.watch_task.cancel()
            await ended(v.watch_task)
            v.watch_task = None
            if not v.watch_ready:
                v.watch_ready = True
                self._unready -= 1
        await self._call_cleanup(v)
        v.res = new
        v.received = {**v.received, **values}
        await self._start_vertex(v)
        log.info(
            "%s: received %s",
            v.ident,
            v.mask(
                ", ".join(
                    f"{k}={'<secret>' if k in v.secret_fields else _short(val)}"
                    for k, val in values.items()
                )
            ),
        )
        return new

    def _send(self, v: Vertex) -> None:
        values = v.res.sent()
        if not values:
            return
        secret = v.res.secret_sent()
        for send, c, recv in v.send_edges:
            if send not in values:
                continue
            value = values[send]
            # Secrets are marked before the receiver sees the value: a value its
            # sender marks, or one that is a secret the sender received; and what
            # the sender knew is masked for the receiver too (a command that got a
            # password may print it).
            if v.secrets:
                c.secrets |= v.secrets
            if send in secret or (isinstance(value, str) and value in v.secrets):
                c.secret_fields |= {recv}
                if isinstance(value, str) and value:
                    c.secrets |= {value}
            current = c.inbox.get(recv, c.received.get(recv, getattr(c.res, recv, None)))
            if current != value:
                c.inbox = {**c.inbox, recv: value}
                c.pending = True


def _as_declared(res: Resource, values: Mapping[str, object]) -> dict[str, object]:
    """Received values as the receiver declares them: a sender of `Any` (value) is
    only checked here, when a value arrives; a mismatch is an InputError."""
    types = {f.name: f.type for f in msgspec.structs.fields(res)}
    out: dict[str, object] = {}
    for k, val in values.items():
        try:
            out[k] = msgspec.convert(val, types[k])
        except msgspec.ValidationError as e:
            raise InputError(f"received {k}: {e}", res.ident) from None
    return out


def with_values(res: Resource, values: dict[str, object]) -> Resource:
    """A copy of `res` with some parameters replaced (group members kept)."""
    new = msgspec.structs.replace(res, **values)
    if res.group_members:
        new.group_members.extend(res.group_members)
    return new


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
