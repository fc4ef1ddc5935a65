"""One D-Bus method call with a deadline (svc, cron and hostname use it): a timeout
or a broken bus is the resource's one-line failure; an error reply is returned for
the caller to word."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from evergraph.errors import ResourceError

if TYPE_CHECKING:
    from dbus_fast import Message
    from dbus_fast.aio import MessageBus


async def call(
    bus: MessageBus,
    dest: str,
    path: str,
    iface: str,
    member: str,
    signature: str,
    body: tuple[Any, ...],
    timeout: float,
) -> Message:
    from dbus_fast import Message

    msg = Message(
        destination=dest,
        path=path,
        interface=iface,
        member=member,
        signature=signature,
        body=list(body),
    )
    try:
        async with asyncio.timeout(timeout):
            reply = await bus.call(msg)
    except TimeoutError:
        raise ResourceError(f"D-Bus {member}: no answer after {timeout:g} s") from None
    except Exception as e:
        raise ResourceError(f"D-Bus {member}: {e}") from None
    if reply is None:
        raise ResourceError(f"D-Bus {member}: no reply")
    return reply
