"""The graph as text or a picture: Graphviz dot and JSON, and through Graphviz's `dot`
program SVG and PNG (what `evergraph graph` prints, and `run --graphviz` writes)."""

from __future__ import annotations

import json
import math
import shutil
import subprocess

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
        attrs, labels = [], []
        if e.notify:
            labels.append("notify")
        if e.send:
            labels.append(f"{e.send} -> {e.recv}")
        if labels:
            attrs.append("label=" + _quote("\n".join(labels)))
        if e.name == "auto":
            attrs.append('style="dotted"')
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


#: the formats `dot -T` draws for us
IMAGE_FORMATS = ("svg", "png")
#: the Debian (and most distributions') package that has the `dot` program
GRAPHVIZ_PACKAGE = "graphviz"


class GraphvizError(Exception):
    """Graphviz's `dot` is not installed, or failed; the message says which."""


def to_image(dot_text: str, fmt: str) -> bytes:
    """`dot_text` drawn by Graphviz's `dot` program as `fmt` (svg or png)."""
    if fmt not in IMAGE_FORMATS:
        raise ValueError(f"not an image format: {fmt!r}")
    exe = shutil.which("dot")
    if exe is None:
        raise GraphvizError(
            f"drawing {fmt} needs Graphviz's `dot` program, which is not on PATH: "
            f"install the {GRAPHVIZ_PACKAGE} package (apt-get install {GRAPHVIZ_PACKAGE})"
        )
    try:
        done = subprocess.run(
            [exe, f"-T{fmt}"], input=dot_text.encode(), capture_output=True, check=False
        )
    except OSError as e:
        raise GraphvizError(f"cannot run {exe}: {e.strerror}") from None
    if done.returncode != 0:
        why = done.stderr.decode(errors="replace").strip().splitlines()
        raise GraphvizError(
            f"{exe} -T{fmt} failed (status {done.returncode}): {why[0] if why else 'no message'}"
        )
    return done.stdout
