"""The graph as text: Graphviz dot and JSON (what `evergraph graph` prints)."""

from __future__ import annotations

import json
import math

import msgspec

from evergraph.engine.contract import Resource
from evergraph.engine.model import GraphModel


def _quote(s: str) -> str:
    """A dot string literal: backslash, quote and newline escaped."""
    escaped = s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return '"' + escaped + '"'


def to_dot(model: GraphModel) -> str:
    lines = [f"digraph {_quote(model.name or 'evergraph')} {{", "  rankdir=LR;"]
    for ident, res in model.resources.items():
        label = ident
        if res.group_members:
            label += "\n+ " + "\n+ ".join(m.ident for m in res.group_members)
        shape = "box" if res.group_members else "ellipse"
        style = ', style="dashed"' if res.meta.hidden else ""
        lines.append(f"  {_quote(ident)} [label={_quote(label)}, shape={shape}{style}];")
    for e in model.edges:
        attrs = []
        if e.notify:
            attrs.append('label="notify"')
        if e.name == "auto":
            attrs.append('style="dotted"')
        if e.send:
            attrs.append(f"label={_quote(f'{e.send} -> {e.recv}')}")
        extra = f" [{', '.join(attrs)}]" if attrs else ""
        lines.append(f"  {_quote(e.from_id)} -> {_quote(e.to_id)}{extra};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _params(res: object) -> dict[str, object]:
    data = msgspec.to_builtins(res)
    assert isinstance(data, dict)
    data.pop("name", None)
    data.pop("meta", None)
    return data


def _meta(res: Resource) -> dict[str, object]:
    """JSON has no infinity: an unlimited `limit` (`.inf`) is null."""
    meta: dict[str, object] = msgspec.to_builtins(res.meta)
    if meta.get("limit") == math.inf:
        meta["limit"] = None
    return meta


def to_json(model: GraphModel) -> str:
    vertices = []
    for ident, res in model.resources.items():
        vertices.append(
            {
                "id": ident,
                "kind": res.kind,
                "name": res.name,
                "params": _params(res),
                "meta": _meta(res),
                "group": [m.ident for m in res.group_members],
            }
        )
    edges = [
        {
            "from": e.from_id,
            "to": e.to_id,
            "notify": e.notify,
            "auto": e.name == "auto",
            **({"send": e.send, "recv": e.recv} if e.send else {}),
        }
        for e in model.edges
    ]
    return json.dumps({"graph": model.name, "vertices": vertices, "edges": edges}, indent=2) + "\n"
