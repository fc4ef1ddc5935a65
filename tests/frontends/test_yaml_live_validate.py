"""A live edit of a YAML graph validates only the resources whose parameters
changed: `validate` checks the parameters alone, so an entry equal to one the
last graph validated is not checked again (`GraphModel.check(valid=)`)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import ClassVar

from evergraph.engine.contract import Registry, Resource, register
from evergraph.frontends.base import Context
from evergraph.frontends.yaml import YamlFrontend
from evergraph.watch import InotifyHub

registry = Registry()


@register("counted", registry=registry)
class Counted(Resource, kw_only=True, dict=True, forbid_unknown_fields=True):
    """Records each validate; `value: bad` is invalid."""

    seen: ClassVar[list[str]] = []
    value: str = ""

    def validate(self) -> None:
        Counted.seen.append(self.name)
        if self.value == "bad":
            raise self.bad("value", "is bad")

    async def check_apply(self, apply: bool) -> bool:
        return True


def _graph(values: dict[str, str]) -> str:
    rows = [f"  - {{name: {n}, value: {v}}}" for n, v in values.items()]
    return "resources:\n  counted:\n" + "\n".join(rows) + "\n"


def test_a_live_edit_validates_only_the_changed_entries(tmp_path: Path) -> None:
    values = {f"r{i}": f"v{i}" for i in range(50)}
    g = tmp_path / "g.yaml"
    g.write_text(_graph(values))

    async def main() -> None:
        async with InotifyHub() as hub:
            pump = asyncio.create_task(hub.run())
            fe = YamlFrontend(g, registry)
            ctx = Context(registry=registry, hostname="h", state_dir=tmp_path, watcher=hub)
            try:
                Counted.seen.clear()
                first = await fe.first(ctx)
                assert len(first.resources) == 50
                assert sorted(Counted.seen) == sorted(values)
                it = fe.updates(ctx).__aiter__()
                Counted.seen.clear()
                values["r7"] = "changed"
                values["r50"] = "new"
                g.write_text(_graph(values))
                model = await asyncio.wait_for(it.__anext__(), 10)
                assert model.resources["counted[r7]"].value == "changed"  # type: ignore[attr-defined]
                assert sorted(Counted.seen) == ["r50", "r7"]
                # an invalid change is still refused (the running graph is kept) ...
                Counted.seen.clear()
                values["r3"] = "bad"
                g.write_text(_graph(values))
                values["r3"] = "fine"
                nxt = asyncio.ensure_future(it.__anext__())
                async with asyncio.timeout(10):
                    while "r3" not in Counted.seen:
                        await asyncio.sleep(0.005)
                assert Counted.seen == ["r3"]
                # ... and the next valid save is checked against the last valid graph
                Counted.seen.clear()
                g.write_text(_graph(values))
                model = await asyncio.wait_for(nxt, 10)
                assert model.resources["counted[r3]"].value == "fine"  # type: ignore[attr-defined]
                assert Counted.seen == ["r3"]
                await it.aclose()  # type: ignore[attr-defined]
                # the inner generators' finalizers run as tasks: let them end
                for _ in range(3):
                    await asyncio.sleep(0)
            finally:
                pump.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pump

    asyncio.run(main())
