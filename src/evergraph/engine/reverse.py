"""Reversal: a `meta.reverse` resource is undone when it leaves the graph.

Before its first apply, the state found is captured as a reversal record (the
resource's `reversal()`: a resource of the same kind that restores it), kept on
disk (store.py; sealed with the host key if the vertex knows a secret). When
the resource leaves the graph, also while the agent was down, the record is
applied once and forgotten; a failed reversal is kept and tried at next start.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from evergraph.engine.state import EngineState
from evergraph.engine.vertex import Vertex
from evergraph.errors import InputError, ResourceError

log = logging.getLogger("evergraph.engine")


class Reversal(EngineState):
    def _capture_reversal(self, v: Vertex) -> None:
        """Before the first apply: record how to restore the state found now."""
        res = v.res
        v.reversal_saved = True
        if self.store.has_reversal(res.kind, res.name):
            return  # captured by an earlier run: that is the state before us
        rev = res.reversal()
        if rev is None:
            return
        record: dict[str, Any] = {"kind": rev.kind, "params": msgspec.to_builtins(rev)}
        try:
            if v.secrets:
                # what it restores may be the previous secret: sealed with the host key
                record["secret_fields"] = sorted(v.secret_fields)
                self.store.save_reversal(res.kind, res.name, record, seal=self.keys().seal_local)
            else:
                self.store.save_reversal(res.kind, res.name, record)
        except (OSError, ResourceError) as e:
            log.error("%s: cannot persist its reversal: %s", v.ident, v.mask(str(e)))

    async def _reverse(self, ident: str, record: dict[str, Any]) -> None:
        """Apply a persisted reversal once; on success forget it."""
        if self.store.is_sealed(record):
            try:
                record = self.store.open_reversal(record, self.keys().open_local)
            except Exception as e:
                log.error("%s: sealed reversal does not open here (kept): %s", ident, e)
                return
        kind_name = str(record.get("kind"))
        if self.registry.get(kind_name) is None:
            log.error("%s: reversal of unknown kind %r kept for later", ident, kind_name)
            return
        from evergraph.engine.build import build  # (a run with no reversal never needs it)

        try:
            rev = build(self.registry, kind_name, dict(record["params"]), f"reversal of {ident}")
        except (InputError, TypeError, KeyError, ValueError) as e:
            log.error("%s: invalid reversal record dropped: %s", ident, e)
            kind, _, rest = ident.partition("[")
            self.store.reversal_done(kind, rest[:-1])
            return
        if self.settings.noop:
            log.info("%s: would reverse (noop)", ident)
            return
        scratch = Vertex(self, rev)
        params, fields = record.get("params"), record.get("secret_fields")
        if isinstance(params, dict) and isinstance(fields, list):
            for f in fields:
                value = params.get(f) if isinstance(f, str) else None
                if isinstance(value, str) and value:
                    scratch.secret_fields |= {f}
                    scratch.secrets |= {value}
        try:
            await rev.init(scratch)
            await rev.check_apply(True)
            await rev.cleanup()
        except Exception as e:
            log.error(
                "%s: reversal failed (kept, retried at next start): %s", ident, scratch.mask(str(e))
            )
            return
        kind, _, rest = ident.partition("[")
        self.store.reversal_done(kind, rest[:-1])
        log.info("%s: left the graph: reversed", ident)
