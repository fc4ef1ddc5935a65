"""print (alias msg): logs a message when it runs."""

from __future__ import annotations

from typing import Annotated

from evergraph.engine.contract import Handle, Resource, doc, register


@register("print", "msg")
class Print(Resource, kw_only=True, dict=True, forbid_unknown_fields=True):
    """Logs `msg` when it is new (and on refresh). It changes nothing on the machine, so
    it is always clean: a second run of the same graph reports no change."""

    groupable = True

    msg: Annotated[str, doc("the message to log")] = ""
    refresh_only: Annotated[bool, doc("log only when refreshed by a notify edge")] = False

    async def init(self, handle: Handle) -> None:
        await super().init(handle)
        self._shown: str | None = None

    async def check_apply(self, apply: bool) -> bool:
        refreshed = self.handle.refresh()
        if self.refresh_only and not refreshed:
            return True
        if self._shown != self.msg or refreshed:
            self.handle.logger.info("%s: %s", self.ident, self.msg)
            self._shown = self.msg
        return True
