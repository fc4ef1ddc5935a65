"""value: holds a value and sends it on (mgmt's `value`).

`any` is any YAML value (text, number, list, mapping); the resource changes
nothing on the machine and is always clean, and after each run it sends `any`
to the parameters its send/recv edges name. It can receive `any` too, from any
sender, so values can be chained. A value is checked against the receiving
parameter's type when it arrives (a number sent to a file's `content` is that
file's failure, naming the parameter), not at load time: `any` has no type.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from evergraph.engine.contract import Resource, doc, register


@register("value")
class Value(Resource, kw_only=True, dict=True, forbid_unknown_fields=True):
    """Holds `any` and sends it on over send/recv edges; changes nothing, always clean."""

    eager = True
    sends: ClassVar[dict[str, Any]] = {"any": Any}

    any: Annotated[Any, doc("the value (any YAML value); unset = nothing is sent")] = None

    def sent(self) -> dict[str, object]:
        return {} if self.any is None else {"any": self.any}

    async def check_apply(self, apply: bool) -> bool:
        return True
