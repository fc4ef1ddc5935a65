"""noop: does nothing; a join point for edges, and a check of the engine itself."""

from __future__ import annotations

from typing import Annotated

from evergraph.engine.contract import Resource, doc, register


@register("noop")
class Noop(Resource, kw_only=True, dict=True, forbid_unknown_fields=True):
    """Does nothing and is always clean; logs when it receives a refresh."""

    eager = True

    groupable = True

    comment: Annotated[str, doc("free text, for the reader of the graph")] = ""

    async def check_apply(self, apply: bool) -> bool:
        if self.handle.refresh():
            self.handle.logger.info("%s: received a refresh", self.ident)
        return True
