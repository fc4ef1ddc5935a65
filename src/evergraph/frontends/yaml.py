"""The YAML frontend (mgmt's yamlgraph layout), with live reload.

Fast path: the Rust-backed `yaml_rs` parser builds plain data (~75 ms for a
10k-resource file where PyYAML takes seconds), msgspec types it. Only when
something is wrong do we parse again with PyYAML, whose node tree carries
line and column, to name `file:line:col` in the error. YAML 1.2 rules apply
(`yes` is a string, `0644` is a number).

mgmt's graphs run unchanged (docs/mgmt-compatibility.md): keys mgmt's own code
no longer has are ignored with one warning each (`file:line:col`); a resource
named `@@name` is exported to every host and hidden here; an integer where
text is wanted takes its source text, as mgmt's reader gives it (`mode: 0741`
is the text "0741", octal); a kind of mgmt's that evergraph lacks is named as
such.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from functools import partial
from itertools import repeat
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from evergraph._util.gc import gc_paused
from evergraph.engine.contract import Registry, Resource
from evergraph.engine.model import CollectSpec, Edge, GraphCycleError, GraphModel
from evergraph.errors import InputError

# The parser itself loads with this module, in the importing (main) thread, even
# though a run served from the parse cache never calls it: a first import of
# yaml_rs inside `evergraph check`'s loading thread crashed the process
# (a segfault in yaml_rs.loads, tests/frontends/test_fuzz_yaml.py, not understood).
from evergraph.frontends import _yaml_rs, early
from evergraph.frontends.base import (
    Context,
    Frontend,
    file_changes,
    graph_text,
    merged,
    read_graph_bytes,
    read_graph_file,
)
from evergraph.frontends.collect import Built, matching, merge, to_resources
from evergraph.frontends.yaml_entries import (
    Entries,
    Known,
    Reparse,
    copy_resource,
    split_entries,
)

#: what other modules take from here (`Entries` and `split_entries` live in yaml_entries.py)
__all__ = ["Entries", "YamlFrontend", "load_yaml", "parse_yaml", "split_entries"]

log = logging.getLogger("evergraph.frontend.yaml")

_TOP_KEYS = ("graph", "resources", "edges", "collect", "comment")
_EDGE_KEYS = ("name", "from", "to", "notify")
_END_KEYS = ("kind", "name")

# -- mgmt's layout ---------------------------------------------------------------
#: keys mgmt's own code no longer has (its reader ignores unknown keys): accepted
#: with one warning each and ignored, with what to use instead. Every other
#: unknown key stays an error.
DROPPED_PARAMS: dict[str, dict[str, str]] = {
    "exec": {
        "timeout": "for a deadline use meta: {timeout: SECONDS}",
        "pollint": "to poll use meta: {poll: SECONDS}",
        "state": "",
    },
}
DROPPED_TOP = {"remote": "the graph runs on this host (mgmt's remote execution over SSH is gone)"}
DROPPED_COLLECT = {"pattern": "collect matches by kind and `filter:`"}
#: warnings per ignored key and file; the rest are counted in one line
WARN_EACH = 20
#: the name prefix of an exported resource in mgmt's layout
EXPORT_PREFIX = "@@"
#: mgmt's resource kinds that evergraph does not provide (yet)
MGMT_KINDS = frozenset(
    {
        "acme:account", "aws:ec2", "bmc:firmware", "bmc:power", "cloudflare:dns",
        "config:etcd", "consul:kv", "deploy:tar", "dhcp:host", "dhcp:range",
        "dhcp:server", "docker:network",
        "firewalld", "fwupd:device", "fwupd:remote", "fwupd:system", "gpio", "gsettings",
        "hetzner:ssh_key", "hetzner:vm", "hetzner:vm_protection",
        "http:server", "http:server:file", "http:server:flag",
        "http:server:proxy", "http:server:ui", "nspawn", "panic",
        "pippet", "ssh:authorized_key", "tftp:file", "tftp:server",
        "virt:builder", "virt:network",
    }
)  # fmt: skip
#: msgspec's complaint about an integer given for a field that takes text
_INT_FOR_TEXT = re.compile(r"^Expected `(?P<types>[^`]*)`, got `int`$")

if TYPE_CHECKING:
    from evergraph.cluster.exports import Exported
    from evergraph.engine.ahead import Ahead
    from evergraph.engine.build import PathPart
    from evergraph.frontends.cache import ParseCache
    from evergraph.frontends.early import Early
    from evergraph.frontends.yaml_edges import RawEdge
    from evergraph.frontends.yaml_load import Locator


def parse_yaml(
    text: str,
    filename: str,
    registry: Registry,
    warn: bool = True,
    valid: Mapping[str, Resource] | None = None,
    entries: Entries | None = None,
    notes: list[str] | None = None,
    section: Early | None = None,
) -> GraphModel:
    """Parse and validate a yamlgraph document; every error names `file:line:col`.
    `warn`: log the keys ignored for mgmt's sake (off when parsing a text again);
    `valid`: resources validated before (`GraphModel.validated()`): equal ones are
    not validated again; `entries`: the last text's resource entries (a live
    frontend's): only entries whose text changed are parsed and built again;
    `notes`: gets each warning given (the parse cache gives them again); `section`:
    the text's `resources:` as `early.parse_section` parsed it (then only the rest
    is parsed here)."""
    with gc_paused():
        try:
            return _parse_yaml(text, filename, registry, warn, valid, entries, notes, section)
        except RecursionError:
            # the parsers and the error path's locator recurse per level of nesting
            raise InputError(
                "nested too deeply to read: flatten the data (a graph needs a few levels)",
                filename,
            ) from None
        except ValueError as e:
            # an integer too long to print (sys.get_int_max_str_digits()), in a message
            if "integer string conversion" not in str(e):
                raise
            from evergraph.frontends.yaml_load import long_number_at

            raise InputError(
                f"a number of more than {sys.get_int_max_str_digits()} digits: "
                "quote it if it is text",
                long_number_at(text, filename),
            ) from None


def _parse_yaml(
    text: str,
    filename: str,
    registry: Registry,
    warn: bool,
    valid: Mapping[str, Resource] | None,
    entries: Entries | None,
    notes: list[str] | None = None,
    section: Early | None = None,
) -> GraphModel:
    # the parser's modules load with the first parse: a run whose model comes from
    # the parse cache (every unchanged re-run) never needs them
    from evergraph.frontends.yaml_load import Locator, load_text

    loc = Locator(filename, text)
    if entries is not None:
        found = entries.reuse(text)
        if found is not None:
            doc, items, kinds, edges = found
            try:
                model, kept = _model(
                    doc, items, filename, registry, loc, warn, valid, text, True, edges, notes
                )
            except Reparse:
                pass  # a key ignored for mgmt's sake: the whole text, to warn as it does
            else:
                entries.keep(text, kept, kinds)
                return model
    doc, fast = _with_early(text, section) if section is not None else (None, None)
    if doc is not None:
        log.debug("%s: its resources: parsed beside the command's start", filename)
    else:
        doc, fast = _with_fast_edges(text)
        if doc is None:
            doc = load_text(text, filename, loc)
    keep = entries is not None
    model, kept = _model(doc, None, filename, registry, loc, warn, valid, text, keep, fast, notes)
    if entries is not None:
        entries.keep(text, kept, None)
    return model


def _with_early(text: str, section: Early) -> tuple[Any, Iterable[RawEdge] | None]:
    """As `_with_fast_edges`, with the `resources:` section parsed, and the edges
    read, by the helper (`section`): the rest of the text parsed here, the section's
    value put in; (None, None) if the rest is not a document whose `resources`
    holds nothing (the whole text's parse then says what and where)."""
    from evergraph.frontends.yaml_edges import load_split, mark_line

    begin, end, resources, cut = section
    try:
        if cut is None:
            rest = text[:begin] + text[end:]
            doc, fast = _with_fast_edges(rest)
            if doc is None:
                doc = _yaml_rs.loads(rest)
        else:  # the edges' section too, cut down to `MARK` (two sections: one first)
            start, stop, d, edges = cut
            if stop <= begin:
                skeleton = text[:start] + mark_line(d) + text[stop:begin] + text[end:]
            elif end <= start:
                skeleton = text[:begin] + text[end:start] + mark_line(d) + text[stop:]
            else:
                return None, None
            doc, fast = load_split(skeleton, edges) or (None, None)
    except Exception:  # (RecursionError too: the whole text's parse raises it again)
        return None, None
    if type(doc) is not dict or "resources" not in doc or doc["resources"] is not None:
        return None, None
    doc["resources"] = resources
    return doc, fast


def _with_fast_edges(text: str) -> tuple[Any, Iterable[RawEdge] | None]:
    """`load_fast`: (the document, its edges), or (None, None) to parse the whole text."""
    from evergraph.frontends.yaml_edges import load_fast

    got = load_fast(text)
    return (None, None) if got is None else got


def _model(
    doc: Any,
    reused: dict[str, list[Any]] | None,
    filename: str,
    registry: Registry,
    loc: Locator,
    warn: bool,
    valid: Mapping[str, Resource] | None,
    text: str,
    keep: bool,
    fast: Iterable[RawEdge] | None = None,
    notes: list[str] | None = None,
) -> tuple[GraphModel, dict[str, list[Resource | Known]] | None]:
    """The checked model of a parsed document, and its resource entries as built
    (per kind as written, a pristine copy of each, as `Known` where it was
    exported or seen before; None when a key was ignored). `reused`: per
    kind, the entries of a re-parse: `Known` where the text was seen before, else
    parsed data; then a key to ignore raises `Reparse`. `keep`: return the
    entries as built (else None). `fast`: the edges as `split_edges` read them
    (the document's `edges` is then empty). `notes`: gets each warning logged."""

    def fail(msg: str, path: tuple[PathPart, ...] = (), key: bool = False) -> InputError:
        return InputError(msg, loc.at(path, key))

    #: warnings given per ignored key (`exec timeout`, `top-level `remote:``), to cap them
    warned: dict[str, int] = {}

    def ignored(what: str, path: tuple[PathPart, ...], hint: str, group: str = "") -> None:
        if reused is not None:
            raise Reparse
        group = group or what
        warned[group] = warned.get(group, 0) + 1
        if warn and warned[group] <= WARN_EACH:
            at, hinted = loc.at(path, key=True), f"; {hint}" if hint else ""
            log.warning("%s: %s: ignored (mgmt's own code no longer has it)%s", at, what, hinted)
            if notes is not None:
                notes.append(f"{at}: {what}: ignored (mgmt's own code no longer has it){hinted}")

    if doc is None:
        raise InputError("the file is empty: expected `graph:` and `resources:`", filename)
    if not isinstance(doc, dict):
        raise fail("the top level must be a mapping with `graph:` and `resources:`")
    for k in doc:
        if k in DROPPED_TOP:
            ignored(f"top-level `{k}:`", (k,), DROPPED_TOP[k])
        elif k not in _TOP_KEYS:
            raise fail(
                f"unknown top-level key {k!r} (expected: {', '.join(_TOP_KEYS)})"
                + _did_you_mean(k, _TOP_KEYS),
                (k,),
                key=True,
            )
    name = doc.get("graph", "")
    if not isinstance(name, str):
        raise fail("`graph` must be a string (the graph's name)", ("graph",))
    model = GraphModel(name=name)
    collect = doc.get("collect") or []
    if not isinstance(collect, list):
        raise fail("`collect` must be a list of {kind: K, filter: {...}}", ("collect",))
    for i, item in enumerate(collect):
        model.collect.append(_collect_spec(item, ("collect", i), fail, registry, ignored))
    resources = doc.get("resources") or {}
    if not isinstance(resources, dict):
        raise fail("`resources` must map each kind to a list of resources", ("resources",))
    kinds = registry.kinds()
    may_export = _may_hold_export(text)
    kept: dict[str, list[Resource | Known]] = {}
    #: each kind's resources as added, for errors found later (where each was declared)
    added: list[tuple[str, list[Resource]]] = []
    graph = model.resources
    for kind, items in resources.items():
        cls = registry.get(str(kind))
        if cls is None:
            if kind in MGMT_KINDS:
                raise fail(
                    f"resource kind {kind!r} is one of mgmt's that evergraph does not provide"
                    " yet (docs/mgmt-compatibility.md)",
                    ("resources", kind),
                    key=True,
                )
            from evergraph.engine.build import known_kinds_hint

            raise fail(
                f"unknown resource kind {kind!r} {known_kinds_hint(kinds, str(kind))}",
                ("resources", kind),
                key=True,
            )
        known: list[Resource | Known] | None = None
        if keep:
            kept[kind] = known = []
        if reused is not None and kind in reused:
            items = reused[kind]
        if items is None:
            continue
        if not isinstance(items, list):
            raise fail(f"`resources.{kind}` must be a list of resources", ("resources", kind))
        built, exported = _built(cls, str(kind), items, fail, loc, ignored, may_export, known)
        here: list[Resource] = []
        added.append((kind, here))
        for i, res in enumerate(built):
            if not res.name:
                raise fail(
                    f"{kind} resource without a `name:` (a non-empty string)",
                    ("resources", kind, i),
                )
            if exported and i in exported and _collected_here(res, model.collect):
                # mgmt's exporter collects its own export too: applied here as well
                res = msgspec.structs.replace(
                    res, meta=msgspec.structs.replace(res.meta, hidden=False)
                )
            here.append(res)
            ident = res.ident
            if ident not in graph:
                graph[ident] = res
                continue
            try:
                model.add(res)
            except InputError as e:
                raise InputError(e.message, loc.at(("resources", kind, i))) from None
    edges = doc.get("edges") or []
    if not isinstance(edges, list):
        raise fail("`edges` must be a list", ("edges",))
    for i, item in enumerate(edges):
        edge = _edge(item, ("edges", i), fail, registry)
        try:
            model.connect(edge)
        except InputError as e:
            raise InputError(e.message, loc.at(("edges", i))) from None
    if fast is not None:
        _connect_read(model, fast, registry, loc)
    for group, count in warned.items():
        if warn and count > WARN_EACH:
            log.warning("%s: %s: %d more ignored the same way", filename, group, count - WARN_EACH)
            if notes is not None:
                notes.append(f"{filename}: {group}: {count - WARN_EACH} more ignored the same way")
    try:
        model.check(valid, keep=keep)
    except GraphCycleError as e:
        # Point at the edge that closes the cycle.
        closing = (e.cycle[-2], e.cycle[-1])
        idx = next((i for i, ed in enumerate(model.edges) if (ed.from_id, ed.to_id) == closing), 0)
        raise InputError(e.message, loc.at(("edges", idx))) from None
    except InputError as e:
        declared: dict[str, tuple[PathPart, ...]] = {}
        for kind, here in added:
            for i, res in enumerate(here):
                declared.setdefault(res.ident, ("resources", kind, i))
        raise InputError(e.message, _where_resource(e.where, declared, loc) or filename) from None
    return model, (kept if keep and not warned else None)


#: an `@` written as an escape (in a double-quoted scalar)
_AT_ESCAPE = re.compile(r"\\(?:x40|u0040|U00000040)")


def _may_hold_export(text: str) -> bool:
    """Whether a name in `text` may start with `@@` (an `@` written as an escape too)."""
    return "@" in text or ("\\" in text and _AT_ESCAPE.search(text) is not None)


def _built(
    cls: type[Resource],
    kind: str,
    items: list[Any],
    fail: Callable[..., InputError],
    loc: Locator,
    ignored: Callable[..., None],
    may_export: bool,
    known: list[Resource | Known] | None,
) -> tuple[list[Resource], set[int]]:
    """A kind's resources (each a new object) and the indexes of those exported;
    `known` (if given) gets each entry as built. `items`: parsed entries, or `Known` ones
    (built before from the same text) among them."""
    fresh = [i for i, it in enumerate(items) if type(it) is not Known]
    raw = items if len(fresh) == len(items) else [items[i] for i in fresh]
    exported: set[int] = set()
    if raw and (may_export or kind in DROPPED_PARAMS):
        exported = {fresh[j] for j in _mgmt_items(cls, kind, raw, ignored)}
    try:
        # one call for the whole list: the fast path for large graphs
        new: list[Resource] = msgspec.convert(raw, list[cls], strict=True)  # type: ignore[valid-type]
    except msgspec.ValidationError:
        # integers for text take their source text; else find the bad one and say where
        new = [_build(cls, kind, items[i], ("resources", kind, i), fail, loc) for i in fresh]
    if raw is items:
        if known is not None:  # a plain copy stands for an entry not exported
            known.extend([r.__copy__() for r in new])  # type: ignore[attr-defined]
            for i in exported:
                known[i] = Known(known[i], True)  # type: ignore[arg-type]
        return new, exported
    built: list[Resource] = []
    fresh_at = dict(zip(fresh, new, strict=True))
    assert known is not None  # `Known` items come with a cache to keep them in
    for i, it in enumerate(items):
        res = fresh_at.get(i)
        if res is None:
            known.append(it)
            built.append(copy_resource(it.template))
            if it.exported:
                exported.add(i)
        else:
            known.append(Known(copy_resource(res), True) if i in exported else copy_resource(res))
            built.append(res)
    return built, exported


def _did_you_mean(word: object, choices: tuple[str, ...]) -> str:
    import difflib

    close = difflib.get_close_matches(str(word), choices, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _mgmt_items(
    cls: type[Resource], kind: str, items: list[Any], ignored: Callable[..., None]
) -> set[int]:
    """mgmt's layout, in place: keys its code dropped are removed (with a warning);
    `@@name` becomes `name` with `meta: {export: ["*"], hidden: true}`. The indexes
    of those exported."""
    dropped = DROPPED_PARAMS.get(kind)
    if dropped is not None:
        fields = {f.name for f in msgspec.structs.fields(cls)}
        dropped = {k: v for k, v in dropped.items() if k not in fields}
    exported: set[int] = set()
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            continue  # reported by the typing below
        name = item.get("name")
        exported_as = (
            name[len(EXPORT_PREFIX) :]
            if isinstance(name, str) and name.startswith(EXPORT_PREFIX)
            else None
        )
        if dropped:
            for key in [k for k in item if k in dropped]:
                del item[key]
                shown = name if exported_as is None else exported_as
                ident = f"{kind}[{shown}]" if isinstance(shown, str) else kind
                path = ("resources", kind, i, key)
                ignored(f"{ident}.{key}", path, dropped[key], f"{kind} {key}")
        if exported_as is not None:
            meta = item.get("meta")
            if meta is None or isinstance(meta, dict):  # else: reported by the typing
                meta = dict(meta or {})
                meta["export"] = meta.get("export") or ["*"]
                meta["hidden"] = True
                item["meta"] = meta
            item["name"] = exported_as
            exported.add(i)
    return exported


def _collected_here(res: Resource, specs: list[CollectSpec]) -> bool:
    """Does one of this graph's collect specs (not limited to other hosts) match `res`?"""
    wanted = [s for s in specs if s.kind == res.kind and s.host is None]
    if not wanted:
        return False
    params = msgspec.to_builtins(res)
    return any(s.matches(res.kind, "", res.name, params) for s in wanted)


def _build(
    cls: type[Resource],
    kind: str,
    item: object,
    path: tuple[PathPart, ...],
    fail: Callable[..., InputError],
    loc: Locator,
) -> Resource:
    """One resource. An integer given where text is wanted takes its source text,
    as mgmt's reader hands it over (`mode: 0741` is "0741", not 741)."""
    from evergraph.engine.build import build_resource, msgspec_path

    for _ in range(1000):  # one integer per round: at most one per field
        try:
            return msgspec.convert(item, cls, strict=True)
        except msgspec.ValidationError as e:
            reason, sub = msgspec_path(str(e))
            m = _INT_FOR_TEXT.match(reason)
            if m is None or "str" not in m["types"].split(" | "):
                break
            fixed = _with_int_texts(item, sub, (*path, *sub), loc)
            if fixed is None:
                break
            item = fixed
    return build_resource(cls, kind, item, path, fail)


def _with_int_texts(
    item: object, sub: tuple[PathPart, ...], where: tuple[PathPart, ...], loc: Locator
) -> object | None:
    """`item` with the integer at `sub` (or, for a mapping there, every integer value
    in it: msgspec does not name a mapping's key) replaced by its source text; None
    when there is no such integer."""
    if not sub:
        if isinstance(item, dict):
            texts = {
                k: loc.int_text((*where, k))
                for k, v in item.items()
                if isinstance(v, int) and not isinstance(v, bool)
            }
            if not texts or None in texts.values():
                return None
            return {**item, **texts}
        if isinstance(item, int) and not isinstance(item, bool):
            return loc.int_text(where)
        return None
    head, rest = sub[0], sub[1:]
    if isinstance(item, dict) and head in item:
        inner = _with_int_texts(item[head], rest, where, loc)
        return None if inner is None else {**item, head: inner}
    if isinstance(item, list) and isinstance(head, int) and head < len(item):
        inner = _with_int_texts(item[head], rest, where, loc)
        return None if inner is None else [*item[:head], inner, *item[head + 1 :]]
    return None


def _collect_spec(
    item: object,
    path: tuple[PathPart, ...],
    fail: Callable[..., InputError],
    registry: Registry,
    ignored: Callable[..., None],
) -> CollectSpec:
    if not isinstance(item, dict):
        raise fail("a collect entry is a mapping {kind: K, filter: {...}}", path)
    for k in item:
        if k in DROPPED_COLLECT:
            ignored(f"collect `{k}:`", (*path, k), DROPPED_COLLECT[k])
        elif k not in ("kind", "filter"):
            raise fail(
                f"unknown key {k!r} in collect (expected kind, filter)"
                + _did_you_mean(k, ("kind", "filter")),
                (*path, k),
                True,
            )
    kind = item.get("kind")
    cls = registry.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise fail(f"collect needs a known `kind:`, not {kind!r}", (*path, "kind"))
    flt = item.get("filter") or {}
    if not isinstance(flt, dict):
        raise fail("`filter` must be a mapping of host, name and parameters", (*path, "filter"))
    host, name, params = None, None, {}
    fields = set(cls.__struct_fields__)
    for k, v in flt.items():
        if k in ("host", "name"):
            if not isinstance(v, str):
                raise fail(f"`{k}` must be a string", (*path, "filter", k))
            host, name = (v, name) if k == "host" else (host, v)
        elif k in fields and k != "meta":
            params[str(k)] = v
        else:
            raise fail(f"{kind} has no parameter {k!r} to filter on", (*path, "filter", k), True)
    return CollectSpec(cls.kind, host, name, params)


def _where_resource(where: str, declared: dict[str, tuple[PathPart, ...]], loc: Locator) -> str:
    """`kind[name].field` -> `file:line:col: kind[name].field` when the field is found
    (`declared`: each identity's data path, under the kind's name or alias as written)."""
    m = re.match(r"^([\w:]+\[.*?\])(?:\.(.+))?$", where)
    if not m or m[1] not in declared:
        return where
    path, field = declared[m[1]], m[2]
    if field:
        path = path + tuple(field.split("."))
    return f"{loc.at(path)}: {where}"


def _edge(
    item: object, path: tuple[PathPart, ...], fail: Callable[..., InputError], registry: Registry
) -> Edge:
    if not isinstance(item, dict):
        raise fail("each edge must be a mapping with `from:` and `to:`", path)
    for k in item:
        if k not in _EDGE_KEYS:
            raise fail(
                f"unknown edge key {k!r} (expected: {', '.join(_EDGE_KEYS)})"
                + _did_you_mean(k, _EDGE_KEYS),
                (*path, k),
                key=True,
            )
    ends: list[str] = []
    values: dict[str, str | None] = {"from": None, "to": None}
    for side, value_key in (("from", "send"), ("to", "recv")):
        end = item.get(side)
        if not isinstance(end, dict):
            raise fail(f"edge `{side}:` must be a mapping {{kind: ..., name: ...}}", (*path, side))
        for k in end:
            if k not in (*_END_KEYS, value_key):
                raise fail(
                    f"unknown key {k!r} in edge `{side}:` (expected: kind, name, {value_key})"
                    + _did_you_mean(k, (*_END_KEYS, value_key)),
                    (*path, side, k),
                    key=True,
                )
        kind, name = end.get("kind"), end.get("name")
        if not isinstance(kind, str) or not isinstance(name, str):
            raise fail(f"edge `{side}:` needs `kind:` and `name:` strings", (*path, side))
        value = end.get(value_key)
        if value is not None and (not isinstance(value, str) or not value):
            raise fail(f"edge `{side}.{value_key}:` must name a field", (*path, side, value_key))
        values[side] = value
        cls = registry.get(kind)  # an alias (msg) names its kind's resources (print)
        ends.append(f"{cls.kind if cls is not None else kind}[{name}]")
    if (values["from"] is None) != (values["to"] is None):
        raise fail("an edge that sends a value needs both `from.send:` and `to.recv:`", path)
    notify = item.get("notify", False)
    if not isinstance(notify, bool):
        raise fail("edge `notify:` must be true or false", (*path, "notify"))
    ename = item.get("name", "")
    return Edge(
        ends[0], ends[1], notify=notify, send=values["from"], recv=values["to"], name=str(ename)
    )


def _connect_read(
    model: GraphModel, read: Iterable[RawEdge], registry: Registry, loc: Locator
) -> None:
    """The edges `split_edges` read, added as `_edge` and `model.connect` add
    them (the same `Edge`s, the same errors). Column by column when every edge
    joins two resources of the graph (~0.5 us an edge: each kind looked up once,
    the idents made by joins); else edge by edge, where each error is found."""
    read = list(read)
    if not read:
        return
    names, from_kinds, from_names, to_kinds, to_names, notifies = zip(*read, strict=True)
    kinds: dict[str, str] = {}
    for kind in set(from_kinds) | set(to_kinds):
        cls = registry.get(kind)  # an alias (msg) names its kind's resources (print)
        kinds[kind] = cls.kind if cls is not None else kind
    froms, tos = _idents(kinds, from_kinds, from_names), _idents(kinds, to_kinds, to_names)
    resources = model.resources
    if (
        all(map(resources.__contains__, froms))
        and all(map(resources.__contains__, tos))
        and not any(map(str.__eq__, froms, tos))
    ):
        fields = zip(
            froms,
            tos,
            repeat(False)
            if notifies.count(None) == len(notifies)
            else [n == "true" for n in notifies],
            repeat(None),
            repeat(None),
            names if None not in names else [n or "" for n in names],
        )
        model.edges.extend(map(_edge_of, fields))  # (Edge(*fields), at C speed)
        return
    append = model.edges.append
    for i, (name, _, _, _, _, notify) in enumerate(read):
        edge = Edge(froms[i], tos[i], notify == "true", None, None, name or "")
        if edge[0] != edge[1] and edge[0] in resources and edge[1] in resources:
            append(edge)
            continue
        try:
            model.connect(edge)
        except InputError as e:
            raise InputError(e.message, loc.at(("edges", i))) from None


def _idents(kinds: dict[str, str], of: tuple[str, ...], names: tuple[str, ...]) -> list[str]:
    """`kind[name]` of each edge's end (`of`: its kind as written): one join and one
    split when one kind is written (a name `split_edges` read holds no NUL)."""
    if of.count(of[0]) == len(of):
        kind = kinds[of[0]]
        return f"{kind}[{f']{NUL}{kind}['.join(names)}]".split(NUL)
    return [f"{kinds[k]}[{n}]" for k, n in zip(of, names, strict=True)]


#: what `_idents` joins with (no name `split_edges` reads holds it)
NUL = "\0"
#: an `Edge` of its six fields in order, as a tuple (`Edge`'s own `__new__` is Python)
_edge_of = partial(tuple.__new__, Edge)


def load_yaml(path: str | Path, registry: Registry) -> GraphModel:
    return parse_yaml(read_graph_file(Path(path)), str(path), registry)


class YamlFrontend(Frontend):
    """A YAML graph file. While running, a saved change swaps the graph, and (with a
    World) so does every change in the exports its `collect:` matches."""

    def __init__(self, path: str | Path, registry: Registry) -> None:
        self.path = Path(path).absolute()
        self.label = str(path)
        self.registry = registry
        self._raw: GraphModel | None = None
        self._text = ""
        #: the last text's resource entries: a live edit builds only those it changed
        self._entries = Entries()
        #: the last graph's resources, as validated (`GraphModel.validated`)
        self._valid: dict[str, Resource] = {}
        #: the exports the running graph was built with, and the specs that found them
        self._found: list[Exported] = []
        self._specs: list[CollectSpec] = []
        #: the collected exports as built last time (an unchanged one is not rebuilt)
        self._built = Built()
        #: where parsed models are kept for the next run (`cache_parses`), if anywhere
        self._cache: ParseCache | None = None
        self._preloading = False
        #: False after `one_shot`: no later graph is asked for, so the text, the
        #: entries and the validated resources a live edit reuses are not kept
        self._follow = True

    def cache_parses(self, state_dir: Path | None) -> None:
        from evergraph.frontends.cache import ParseCache, default_dir

        directory = default_dir(state_dir)
        if self._cache is None or self._cache.directory != directory:
            # (the same one kept: it may hold the entry of a parse made before the
            # state dir existed, for `first` to write)
            self._cache = ParseCache(directory, within=state_dir)

    def one_shot(self) -> None:
        self._follow = False

    def load(self) -> GraphModel:
        """Parse the file now (InputError), or take its model from the parse cache."""
        try:
            return self._load()
        finally:
            early.drop()  # (a helper forked as the command started: not needed)

    def _load(self) -> GraphModel:
        data = read_graph_bytes(self.path)
        cache, key, notes = self._cache, "", list[str]()
        follow = self._follow
        if cache is not None:
            from evergraph.frontends.cache import entry_key

            key = entry_key(data, str(self.path), self.registry)
            cached = cache.get(key, self.registry, keep=follow)
            if cached is not None:
                # (a one-shot hit never decodes the text: these bytes parsed, so
                # they are UTF-8, and nothing reads it; W1 10k: 2.7 MB)
                if follow:
                    text = graph_text(data, self.path)
                    self._entries.keep(text, None, None)  # a first edit parses the whole text
                    self._text, self._valid = text, cached.validated()
                return cached
        text = graph_text(data, self.path)
        entries = self._entries if follow else None
        model = parse_yaml(
            text,
            str(self.path),
            self.registry,
            entries=entries,
            notes=notes,
            section=early.take(data),
        )
        if follow:
            self._text, self._valid = text, model.validated()
        if cache is not None:
            cache.put(key, model, notes, self.registry, later=self._preloading, source=data)
        return model

    def graph_file(self) -> Path:
        return self.path

    def preload(self) -> None:
        if self._raw is None:
            # (a first parse's cache entry is encoded by `first`: the work ahead
            # starts before it, see check_ahead; its automatic edges are found now)
            self._preloading = True
            try:
                self._raw = self.load()
            finally:
                self._preloading = False

    def check_ahead(self, creates: bool, journal: Path | None = None) -> Ahead | None:
        raw = self._raw
        if raw is None or raw.ahead is not None:
            return None
        from evergraph.engine.ahead import Ahead

        cache = self._cache
        chore = (
            (cache.encode_later, cache.write_held)
            if cache is not None and cache.holds_later()
            else None
        )
        raw.ahead = Ahead.start(
            raw, creates=creates and not raw.collect, journal=journal, chore=chore
        )
        if raw.ahead is not None and cache is not None and chore is not None:
            cache.drop_later()  # (the first child encodes and writes the entry)
        return raw.ahead

    async def first(self, ctx: Context) -> GraphModel:
        raw, self._raw = self._raw or self.load(), None
        if self._cache is not None:
            self._cache.flush()  # a first run's parse: its state dir exists now
        self._specs = list(raw.collect)
        if raw.collect and ctx.collector is not None:
            self._found = matching(await ctx.collected(), raw.collect)
            return merge(raw, to_resources(self.registry, self._found, self._built))
        return raw

    async def updates(self, ctx: Context) -> AsyncIterator[GraphModel]:
        if ctx.watcher is None:
            return
        import asyncio  # here: `check` parses without an event loop

        collector = ctx.collector
        found: asyncio.Queue[bool] = asyncio.Queue()
        unlisten = collector.listen(lambda: found.put_nowait(True)) if collector else None

        async def exports() -> AsyncIterator[tuple[str, Any]]:
            while True:
                yield "collected", await found.get()

        async def texts() -> AsyncIterator[tuple[str, Any]]:
            async for text in file_changes(ctx.watcher, self.path, self._text):
                yield "file", text

        try:
            async for what, payload in merged(texts(), exports()):
                if what == "file":
                    try:
                        raw = parse_yaml(
                            payload,
                            str(self.path),
                            self.registry,
                            valid=self._valid,
                            entries=self._entries,
                        )
                    except InputError as e:
                        log.error("%s (the running graph is kept)", e)
                        continue
                    self._text, self._valid = payload, raw.validated()
                    log.info("%s changed: swapping the graph live", self.path)
                else:
                    raw = parse_yaml(
                        self._text,
                        str(self.path),
                        self.registry,
                        warn=False,
                        valid=self._valid,
                        entries=self._entries,
                    )
                now = matching(collector.current(), raw.collect) if collector else []
                if what == "collected":
                    if now == self._found:
                        continue  # a change this graph does not collect
                    log.info("collected exports changed: swapping the graph live")
                self._found = now
                yield merge(raw, to_resources(self.registry, now, self._built))
        finally:
            if unlisten is not None:
                unlisten()
