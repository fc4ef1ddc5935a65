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

#: an edge as read: (name, from kind, from name, to kind, to name, notify)
RawEdge = tuple[str, str, str, str, str, bool]

#: a scalar YAML reads as this very text: plain (ASCII, starting with a letter or
#: `/`, never a YAML keyword, not ending in `:`) or quoted (printable ASCII, no
#: escapes).
#: ASCII classes, not `\w`: the section is read twice as fast.
_S = (
    r"((?!(?:true|false|null|True|False|TRUE|FALSE|Null|NULL)\n)"
    r"[A-Za-z/][A-Za-z0-9_.\-/:]*(?<!:)"
    r"|\"[ !#-\[\]-~]*\"|'[ -&(-~]*')"  # printable ASCII but `"` and `\`, or `'`
)


def _block(d: str) -> re.Pattern[str]:
    """One edge block with its `-` after `d` (the sequence's indentation)."""
    return re.compile(
        rf"{d}- (?:name: {_S}\n{d}  from:|from:)\n"
        rf"{d}    kind: {_S}\n{d}    name: {_S}\n"
        rf"{d}  to:\n{d}    kind: {_S}\n{d}    name: {_S}\n"
        rf"(?:{d}  notify: (true|false)\n)?"
    )


_BLOCKS: dict[int, re.Pattern[str]] = {}
_SPACES = re.compile(r" *")
#: the one item the skeleton's `edges:` holds: the caller sees it there alone,
#: so the cut section was the whole value of the top-level key
MARK = "evergraph-read-these-edges"


def _text(v: str) -> str:
    return v[1:-1] if v[0] in "\"'" else v


def split_edges(text: str) -> tuple[str, list[RawEdge]] | None:
    """The text with its `edges:` section cut down to one item, `MARK` (the
    skeleton), and the section's edges as read; None when they are not laid
    out as this module reads for certain (then parse the whole text)."""
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
    # CRs (`[^"]` takes one) and a directive (`%YAML 1.1`: `yes` would be true)
    if "\r" in text or ("%" in text and (text[0] == "%" or "\n%" in text)):
        return None
    if MARK in text:
        return None
    d = _SPACES.match(text, start).end() - start  # type: ignore[union-attr]
    if text.startswith("\t", start) or not text.startswith("- ", start + d):
        return None
    pat = _BLOCKS.get(d)
    if pat is None:
        pat = _BLOCKS[d] = _block(" " * d)
    read: list[Any] = []  # each match's groups (a name or notify not given: None)
    add = read.append
    pos = start
    for m in pat.finditer(text, start):
        if m.start() != pos:
            break
        add(m.groups())
        pos = m.end()
    # the section must end here: at the end of the text or at the next top-level key
    if pos < len(text) and not (text[pos].isalpha() or text[pos] in "_\"'"):
        return None
    if not read:
        return None
    section = text[start:pos]
    edges: list[RawEdge]
    if '"' in section or "'" in section:
        edges = [
            (
                "" if n is None else _text(n),
                _text(fk),
                _text(fn),
                _text(tk),
                _text(tn),
                nt == "true",
            )
            for n, fk, fn, tk, tn, nt in read
        ]
    else:
        edges = [
            ("" if n is None else n, fk, fn, tk, tn, nt == "true") for n, fk, fn, tk, tn, nt in read
        ]
    return f"{text[:start]}{' ' * d}- {MARK}\n{text[pos:]}", edges
