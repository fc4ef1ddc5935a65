"""The YAML frontend's fast path for explicit edges (issue 28).

mgmt's layout writes each edge as a seven-line block (`- name: e1`, `from:`,
`kind:`, `name:`, `to:`, `kind:`, `name:`). The YAML parser makes three
mappings and ten scalars of each (~4 us), then `_edge` checks them key by key
(~3 us): W1's 10k edges cost ~80 ms, about what its 10k resources cost. Here
one regular expression reads the `edges:` section (~1 us an edge) when, and
only when, every line of it is such a block, and the YAML parser reads the
rest: the skeleton, where the section is cut down to one item, `MARK`.

Sure or not at all, as `yaml_entries.py`: whatever this module cannot read
exactly as the YAML parser would (comments, blank lines, trailing spaces,
flow style, other key orders, `send`/`recv`, escapes, non-ASCII, a plain
scalar YAML reads as other than text, CRs, directives), the whole text is
parsed as before. The caller checks that the skeleton's top-level `edges` is
`[MARK]` alone (so the cut section was that key's whole value, not text in a
string or another document). Errors are the same either way: a text whose
skeleton the YAML parser refuses is parsed whole, and the model's errors name
`file:line:col` in the whole text.
"""

from __future__ import annotations

import re
from typing import Any

from evergraph.frontends import _yaml_rs as yaml_rs

#: an edge as read: (name, from kind, from name, to kind, to name, notify), a
#: match's groups: None for a name or notify not given, notify as written
RawEdge = tuple[str | None, str, str, str, str, str | None]

#: a scalar YAML reads as this very text: plain (ASCII, starting with a letter or
#: `/`, never a YAML keyword, not ending in `:`) or quoted (printable ASCII, no
#: escapes).
#: ASCII classes, not `\w`: the section is read twice as fast.
_S = (
    r"((?!(?:true|false|null|True|False|TRUE|FALSE|Null|NULL)\n)"
    r"[A-Za-z/][A-Za-z0-9_.\-/:]*(?<!:)"
    r"|\"[ !#-\[\]-~]*\"|'[ -&(-~]*')"  # printable ASCII but `"` and `\`, or `'`
)


def _block(d: str, group: str) -> str:
    """One edge block with its `-` after `d` (the sequence's indentation);
    `group`: `(` to capture the values, `(?:` not to."""
    v = _S.replace("(", group, 1)
    return (
        rf"{d}- (?:name: {v}\n{d}  from:|from:)\n"
        rf"{d}    kind: {v}\n{d}    name: {v}\n"
        rf"{d}  to:\n{d}    kind: {v}\n{d}    name: {v}\n"
        rf"(?:{d}  notify: {group}true|false)\n)?"
    )


#: per indentation: one block, capturing
_PATTERNS: dict[int, re.Pattern[str]] = {}
_SPACES = re.compile(r" *")
#: the one item the skeleton's `edges:` holds: the caller sees it there alone,
#: so the cut section was the whole value of the top-level key
MARK = "evergraph-read-these-edges"


def _pattern(d: int) -> re.Pattern[str]:
    got = _PATTERNS.get(d)
    if got is None:
        got = _PATTERNS[d] = re.compile(_block(" " * d, "("))
    return got


def _text(v: str) -> str:
    return v[1:-1] if v[0] in "\"'" else v


#: where a text's `edges:` blocks are and what they say: (where the section's
#: value begins, where it ends, its indentation, its edges)
Cut = tuple[int, int, int, list[RawEdge]]


def mark_line(d: int) -> str:
    """What stands for the cut section in the skeleton: `MARK`, one item at `d`."""
    return f"{' ' * d}- {MARK}\n"


def split_edges(text: str) -> tuple[str, list[RawEdge]] | None:
    """The text with its `edges:` section cut down to one item, `MARK` (the
    skeleton), and the section's edges; None when they are not laid out as this
    module reads for certain (then parse the whole text)."""
    cut = cut_edges(text)
    if cut is None:
        return None
    start, end, d, edges = cut
    return f"{text[:start]}{mark_line(d)}{text[end:]}", edges


def cut_edges(text: str) -> Cut | None:
    """Where `split_edges` cuts, and the edges it reads. One pass: the blocks must
    follow each other from the section's start to its end."""
    # the top-level `edges:` key alone on its line, once
    if text.startswith("edges:\n"):
        start = 7
    else:
        at = text.find("\nedges:\n")
        if at < 0:
            return None
        start = at + 8
    if text.find("\nedges:\n", start - 1) >= 0:
        return None
    # CR line ends, a directive (`%YAML 1.1`: `yes` would be true), our mark
    if "\r" in text or ("%" in text and (text[0] == "%" or "\n%" in text)) or MARK in text:
        return None
    d = _SPACES.match(text, start).end() - start  # type: ignore[union-attr]
    if not text.startswith("- ", start + d):
        return None
    end = start
    edges: list[RawEdge] = []
    for m in _pattern(d).finditer(text, start):
        if m.start() != end:
            break  # (not the next block: the run of blocks ended before it)
        end = m.end()
        edges.append(m.groups())  # type: ignore[arg-type]
    # the section must end here: at the end of the text or at the next top-level key
    if end == start or (end < len(text) and not (text[end].isalpha() or text[end] in "_\"'")):
        return None
    if '"' in text[start:end] or "'" in text[start:end]:
        edges = [
            (n if n is None else _text(n), _text(fk), _text(fn), _text(tk), _text(tn), nt)
            for n, fk, fn, tk, tn, nt in edges
        ]
    return start, end, d, edges


def load_fast(text: str) -> tuple[Any, list[RawEdge]] | None:
    """The parsed text and its edges when `split_edges` reads them (the YAML
    parser reads the rest; the document's `edges` is then null); None: parse
    the whole text. Any doubt, and any error in the rest, goes to the whole
    text's parse, which says what and where."""
    split = split_edges(text)
    return None if split is None else load_split(*split)


def load_split(skeleton: str, edges: list[RawEdge]) -> tuple[Any, list[RawEdge]] | None:
    """`load_fast` of a text `split_edges` split: its skeleton and its edges."""
    try:
        doc = yaml_rs.loads(skeleton)
    except Exception:
        return None
    # the cut section was the top-level key's whole value: `MARK` alone is left
    if type(doc) is not dict or doc.get("edges") != [MARK]:
        return None
    doc["edges"] = None
    return doc, edges
