"""The YAML frontend's entry-wise re-parse: a live frontend's graph file, saved
again, has only the resource entries whose text changed parsed and built again
(the rest are copies of what the last parse built). Sure or not at all: whatever
this module cannot tell exactly, the whole text is parsed (frontends/yaml.py)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from evergraph.engine.contract import R, Resource
from evergraph.frontends.yaml_layout import may_alias, resources_section

if TYPE_CHECKING:
    from evergraph.frontends.yaml_edges import RawEdge


def copy_resource(res: R) -> R:
    """A new object of `res`'s fields alone (not its state: `__dict__`), ~0.1 us."""
    return res.__copy__()  # type: ignore[attr-defined,no-any-return]


class Reparse(Exception):
    """The entry-wise re-parse cannot tell exactly what the whole text does."""


class Known:
    """A resource entry built before: a pristine copy of it (never handed out:
    each graph gets a copy of its own, as the engine and autogroup keep state on
    theirs), and whether it was exported (`@@name`)."""

    __slots__ = ("exported", "template")

    def __init__(self, template: Resource, exported: bool) -> None:
        self.template = template
        self.exported = exported


#: a kind's key alone on its line (after the indentation)
_KIND_LINE = re.compile(r"([A-Za-z_][\w:.\-]*):(?:[ ]+(?:#.*)?)?")
#: the next line with content (not a comment): its indentation and first character
_NEXT_CONTENT = re.compile(r"\n( *)([^ \n#])")


#: re-parse entry by entry while at most this share of them changed (else the
#: whole text in one parser call is faster)
_REPARSE_SHARE = 4
#: per indentation k of the kinds: a line at k, not an entry or a comment
_KIND_AT: dict[int, re.Pattern[str]] = {}


def _kind_line(k: int) -> re.Pattern[str]:
    pat = _KIND_AT.get(k)
    if pat is None:
        pat = _KIND_AT[k] = re.compile(rf"\n {{{k}}}([^ \n#-][^\n]*)")
    return pat


#: per indentation d of a kind's entries: a line among them that is neither an
#: entry (`-` at d, then a space or the end of the line), a comment, nor more indented
_OFF_LINE: dict[int, re.Pattern[str]] = {}


def _off_line(d: int) -> re.Pattern[str]:
    pat = _OFF_LINE.get(d)
    if pat is None:
        pat = _OFF_LINE[d] = re.compile(
            rf"\n(?: {{0,{d - 1}}}[^ \n#]| {{{d}}}(?:[^ \n#-]|-[^ \n]))"
        )
    return pat


#: a text split into entries: (the skeleton, per kind (as written): the
#: indentation of its entries and each entry's text after its `-`, whether
#: the last entry ends the text)
Split = tuple[str, list[tuple[str, int, list[str]]], bool]


def split_entries(text: str) -> Split | None:
    """The text without its resource entries (the skeleton: the rest, kinds'
    keys included), and each kind's entries as source text, in order. Entries
    are the items of the block sequences under `resources:`'s kinds, each from
    its `-` to the next line at the same or a lower indentation. None when the
    text is not laid out that way for certain (tabs or CRs at line starts,
    directives, flow style, anything else under `resources:`)."""
    section = resources_section(text)
    if section is None:
        return None
    _, start, end = section
    first = _NEXT_CONTENT.search(text, start, end)
    if first is None:
        return None
    k = len(first[1])
    heads = [(km.start(), km.end(), km[1]) for km in _kind_line(k).finditer(text, start, end + 1)]
    if not heads or heads[0][0] != first.start():
        return None
    kinds: list[tuple[str, int, list[str]]] = []
    removed: list[tuple[int, int]] = []
    for j, (_, head_end, head) in enumerate(heads):
        km = _KIND_LINE.fullmatch(head)
        if km is None:
            return None
        block_end = heads[j + 1][0] if j + 1 < len(heads) else end
        entry = _NEXT_CONTENT.search(text, head_end, block_end)
        if entry is None:
            kinds.append((km[1], -1, []))  # no entries (comments at most)
            continue
        d = len(entry[1])
        if entry[2] != "-" or d < k or _off_line(d).search(text, entry.start(), block_end):
            return None
        chunks = text[entry.start() : block_end].split(f"\n{' ' * d}-")
        kinds.append((km[1], d, chunks[1:]))
        removed.append((entry.start(), block_end))
    parts: list[str] = []
    pos = 0
    for a, b in removed:
        parts.append(text[pos:a])
        pos = b
    parts.append(text[pos:])
    at_end = end == len(text) - 1  # (no line at column 0 after the section)
    return "".join(parts), kinds, at_end and bool(kinds) and bool(kinds[-1][2])


#: parsed entries per kind (`Known` where built before), by kind as written
Items = dict[str, list[Any]]


class Entries:
    """The resource entries of the last text parsed (a live frontend keeps one),
    by their source text: a re-parse builds only the entries whose text changed.

    Sure or not at all: the text is split by `split_entries`, each new entry is
    parsed alone and must be one item, the skeleton (all but the entries) is
    parsed alone and must hold each kind's key with nothing under it; no alias
    may reach across (an entry or skeleton with a possible `*alias` is parsed
    whole), and a key ignored for mgmt's sake makes it parse whole (to warn as
    it always does). Otherwise the whole text is parsed as before. Errors are
    the same either way: they name `file:line:col` in the whole text."""

    def __init__(self) -> None:
        self._text = ""
        #: the last text's entries as built, per kind (None: not to be reused)
        self._kept: dict[str, list[Resource | Known]] | None = None
        #: the same by source text (per kind: its entries' indentation, then by
        #: text), once the last text was split
        self._by_text: dict[str, tuple[int, dict[str, Known]]] | None = None

    def keep(
        self, text: str, kept: dict[str, list[Resource | Known]] | None, split: Split | None
    ) -> None:
        """After a parse of `text`: its entries as built (`split`: its split, if made)."""
        self._text, self._kept, self._by_text = text, kept, None
        if kept is not None and split is not None:
            self._by_text = _paired(split, kept, False)

    def _known(self) -> dict[str, tuple[int, dict[str, Known]]] | None:
        if self._by_text is None and self._kept is not None:
            split = split_entries(self._text)
            aliases = may_alias(self._text)
            self._by_text = None if split is None else _paired(split, self._kept, aliases)
            if self._by_text is None:
                self._kept = None  # this text does not split: not again
        return self._by_text

    def reuse(self, text: str) -> tuple[Any, Items, Split, Iterable[RawEdge] | None] | None:
        """The parsed skeleton of `text` and its entries (`Known` where their
        text is known), its split, and its edges if `yaml_edges` read them (the
        skeleton's `edges` is then null); None: parse the whole text."""
        known = self._known()
        if known is None:
            return None
        split = split_entries(text)
        if split is None:
            return None
        skeleton, kinds, last_at_end = split
        if may_alias(skeleton):
            return None
        misses = 0
        limit = max(64, sum(len(texts) for _, _, texts in kinds) // _REPARSE_SHARE)
        items: Items = {}
        #: the entry that ends the text is never reused: its end may read differently
        at_end = (len(kinds) - 1, len(kinds[-1][2]) - 1) if last_at_end else (-1, -1)
        for j, (kind, d, texts) in enumerate(kinds):
            was_d, seen = known.get(kind, (-1, {}))
            if was_d != d:
                seen = {}
            got: list[Any] = []
            for i, t in enumerate(texts):
                end = (j, i) == at_end
                hit = None if end else seen.get(t)
                if hit is not None:
                    got.append(hit)
                    continue
                misses += 1
                if misses > limit or may_alias(t):
                    return None
                parsed = _entry(d, t, end)
                if parsed is None:
                    return None
                got.append(parsed[0])
            if texts:
                items[kind] = got
        # explicit edges in mgmt's layout: read by yaml_edges, as in a whole parse
        # (the parser's modules load with the first parse: see yaml._parse_yaml)
        from evergraph.frontends import _yaml_rs as yaml_rs
        from evergraph.frontends.yaml_edges import load_fast

        fast = load_fast(skeleton)
        edges = None
        if fast is not None:
            doc, edges = fast
        else:
            try:
                doc = yaml_rs.loads(skeleton)
            except Exception:
                return None
        res = doc.get("resources") if type(doc) is dict else None
        if type(res) is not dict or list(res) != [kind for kind, _, _ in kinds]:
            return None
        if any(texts and res[kind] is not None for kind, _, texts in kinds):
            return None
        return doc, items, split, edges


def _entry(d: int, text: str, at_end: bool) -> list[Any] | None:
    """One entry's text (after its `-`) parsed alone, as a list holding its
    value; None if it is not exactly one entry. Followed by a next entry as
    in the text (yaml_rs reads an empty block scalar at the very end as a line
    break, elsewhere as empty), unless `at_end`: it ends the text."""
    from evergraph.frontends import _yaml_rs as yaml_rs

    indent = " " * d
    parsed: Any
    try:
        if at_end:
            parsed = yaml_rs.loads(f"{indent}-{text}")
        else:
            parsed = yaml_rs.loads(f"{indent}-{text}\n{indent}- 0\n")
    except Exception:  # the whole text's parse says what and where
        return None
    if type(parsed) is not list or len(parsed) != 1 + (not at_end):
        return None
    if not at_end and (type(parsed[1]) is not int or parsed[1] != 0):
        return None
    return parsed


def _paired(
    split: Split, kept: dict[str, list[Resource | Known]], aliases: bool
) -> dict[str, tuple[int, dict[str, Known]]] | None:
    """A text's entries by source text, from its parse's entries (`kept`): one
    to one when each kind has as many entries as the split found. `aliases`:
    the text may hold one: an entry with a possible alias is left out (its
    value may come from elsewhere); so is an entry that ends the text (its
    end may read differently elsewhere)."""
    if [kind for kind, _, _ in split[1]] != list(kept):
        return None
    out: dict[str, tuple[int, dict[str, Known]]] = {}
    for j, (kind, d, texts) in enumerate(split[1]):
        built = kept[kind]
        if len(built) != len(texts):
            return None
        pairs = zip(texts, built, strict=True)
        if split[2] and j == len(split[1]) - 1:
            pairs = zip(texts[:-1], built[:-1], strict=True)
        out[kind] = (
            d,
            {
                t: b if type(b) is Known else Known(b, False)  # type: ignore[arg-type]
                for t, b in pairs
                if not (aliases and may_alias(t))
            },
        )
    return out
