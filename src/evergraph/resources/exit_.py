"""exit: ends the run with an exit status when the graph reaches it (mgmt's `exit`).

Reached means what it means for every resource: its parents are clean. The
agent then stops as on a first SIGTERM (in-flight applies finish) and exits
with `code`, whatever else happened; the first `exit` reached decides. Under
noop it only reports that it would exit. mgmt's warning holds: under a
service manager that restarts the agent, an `exit` reached at once loops.
"""

from __future__ import annotations

from typing import Annotated

from evergraph.engine.contract import Resource, doc, register


@register("exit")
class Exit(Resource, kw_only=True, dict=True, forbid_unknown_fields=True):
    """Ends the run with status `code` once its parents are clean."""

    code: Annotated[int, doc("the exit status, 0 to 125 (mgmt's range)")] = 0
    message: Annotated[str, doc("logged when it asks to exit")] = ""

    def validate(self) -> None:
        if not 0 <= self.code <= 125:
            raise self.bad("code", f"{self.code} is not between 0 and 125")

    async def check_apply(self, apply: bool) -> bool:
        self.handle.changed("exit", None, self.code)
        if not apply:
            return False
        if self.message:
            self.handle.logger.info("%s: %s", self.ident, self.message)
        self.handle.request_exit(self.code)
        return False
