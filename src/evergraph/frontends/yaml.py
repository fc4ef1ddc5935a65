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

import difflib
import logging
import re
import sys
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import yaml_rs

from evergraph._util.gc import gc_paused
from evergraph.engine.build import PathPart, build_resource, known_kinds_hint, msgspec_path
from evergraph.engine.contract import Registry, Resource
from evergraph.engine.model import CollectSpec, Edge, GraphCycleError, GraphModel
from evergraph.errors import InputError
from evergraph.frontends.base import Context, Frontend, file_changes, merged, read_graph_file
from evergraph.frontends.collect import matching, merge, to_resources

log = logging.getLogger("evergraph.frontend.yaml")

_TOP_KEYS = ("graph", "resources", "edges", "collect", "comment")
_EDGE_KEYS = ("name", "from", "to", "notify")
_END_KEYS = ("kind", "name")
_LINE_COL = re.compile(r"line (\d+), column (\d+)")

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
        "dhcp:server", "docker:container", "docker:image", "docker:network",
        "firewalld", "fwupd:device", "fwupd:remote", "fwupd:system", "gpio", "gsettings",
        "hetzner:ssh_key", "hetzner:vm", "hetzner:vm_protection",
        "http:server", "http:server:file", "http:server:flag",
        "http:server:proxy", "http:server:ui", "nspawn", "panic",
        "pippet", "ssh:authorized_key", "tftp:file", "tftp:server",
        "virt", "virt:builder", "virt:network",
    }
)  # fmt: skip
#: msgspec's complaint about an integer given for a field that takes text
_INT_FOR_TEXT = re.compile(r"^Expected `(?P<types>[^`]*)`, got `int`$")
#: how an integer may be written in YAML (decimal, octal, hex, with `_`)
_INT_SOURCE = re.compile(r"[-+]?[0-9][0-9a-fA-FoObBxX_]*")

if TYPE_CHECKING:
    from evergraph.world.exports import Exported


class _Locator:
    """Maps a data path (keys and indexes) to `file:line:col`, parsing lazily with PyYAML."""

    def __init__(self, filename: str, text: str) -> None:
        self.filename = filename
        self.text = text
        self._root: Any = None
        self._parsed = False

    def _tree(self) -> Any:
        if not self._parsed:
            import yaml  # only on the error path

            self._parsed = True
            try:
                # libyaml's loader where there is one: 5x faster on a large file
                loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
                self._root = yaml.compose(self.text, Loader=loader)
            except yaml.YAMLError:
                self._root = None
        return self._root

    def _walk(self, path: tuple[PathPart, ...]) -> tuple[Any, Any, bool]:
        """(deepest node reached on `path`, the last key node passed, reached the end)."""
        node = self._tree()
        best = node
        last_key = None
        for part in path:
            if node is None:
                return best, None, False
            nxt = None
            last_key = None
            if isinstance(part, int) and node.id == "sequence":
                if part < len(node.value):
                    nxt = node.value[part]
            elif node.id == "mapping":
                for k, v in node.value:
                    if k.value == part:
                        nxt, last_key = v, k
                        break
            if nxt is None:
                return best, None, False
            node = best = nxt
        return best, last_key, True

    def at(self, path: tuple[PathPart, ...], key: bool = False) -> str:
        """Location of the value at `path` (with key=True: of the last key itself)."""
        best, last_key, _ = self._walk(path)
        target = last_key if key and last_key is not None else best
        if target is None:
            return self.filename
        m = target.start_mark
        return f"{self.filename}:{m.line + 1}:{m.column + 1}"

    def int_text(self, path: tuple[PathPart, ...]) -> str | None:
        """The source text of the plain integer scalar at `path` (`0741`), or None."""
        node, _, found = self._walk(path)
        # plain style: None (libyaml's loader: ""), not quoted
        if not found or node is None or node.id != "scalar" or node.style:
            return None
        text = str(node.value)
        return text if _INT_SOURCE.fullmatch(text) else None

    def complex_key(self) -> str:
        """Location of the first mapping key that is a mapping or a list."""
        return self._first_key(lambda k, seen: k.id != "scalar")

    def duplicate_key(self) -> str:
        """Location of the first repeated mapping key (yaml_rs does not tell)."""
        return self._first_key(lambda k, seen: k.id == "scalar" and k.value in seen)

    def _first_key(self, bad: Callable[[Any, set[object]], bool]) -> str:
        """Location of the first mapping key `bad(key, scalar keys before it)` is true for."""
        root = self._tree()
        stack = [root] if root is not None else []
        while stack:
            n = stack.pop()
            if n.id == "mapping":
                seen: set[object] = set()
                for k, v in n.value:
                    if bad(k, seen):
                        m = k.start_mark
                        return f"{self.filename}:{m.line + 1}:{m.column + 1}"
                    if k.id == "scalar":
                        seen.add(k.value)
                    stack.append(v)
            elif n.id == "sequence":
                stack.extend(n.value)
        return self.filename


def parse_yaml(
    text: str,
    filename: str,
    registry: Registry,
    warn: bool = True,
    valid: Mapping[str, Resource] | None = None,
) -> GraphModel:
    """Parse and validate a yamlgraph document; every error names `file:line:col`.
    `warn`: log the keys ignored for mgmt's sake (off when parsing a text again);
    `valid`: resources validated before (`GraphModel.validated()`): equal ones are
    not validated again."""
    with gc_paused():
        try:
            return _parse_yaml(text, filename, registry, warn, valid)
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
            raise InputError(
                f"a number of more than {sys.get_int_max_str_digits()} digits: "
                "quote it if it is text",
                _long_number(text, filename),
            ) from None


def _long_number(text: str, filename: str) -> str:
    """`file:line:col` of the first number too long to print."""
    m = re.search(rf"\d{{{sys.get_int_max_str_digits() + 1},}}", text)
    if m is None:
        return filename
    line = text.count("\n", 0, m.start()) + 1
    col = m.start() - (text.rfind("\n", 0, m.start()) + 1) + 1
    return f"{filename}:{line}:{col}"


def _parse_yaml(
    text: str,
    filename: str,
    registry: Registry,
    warn: bool,
    valid: Mapping[str, Resource] | None,
) -> GraphModel:
    loc = _Locator(filename, text)

    def fail(msg: str, path: tuple[PathPart, ...] = (), key: bool = False) -> InputError:
        return InputError(msg, loc.at(path, key))

    #: warnings given per ignored key (`exec timeout`, `top-level `remote:``), to cap them
    warned: dict[str, int] = {}

    def ignored(what: str, path: tuple[PathPart, ...], hint: str, group: str = "") -> None:
        group = group or what
        warned[group] = warned.get(group, 0) + 1
        if warn and warned[group] <= WARN_EACH:
            log.warning(
                "%s: %s: ignored (mgmt's own code no longer has it)%s",
                loc.at(path, key=True),
                what,
                f"; {hint}" if hint else "",
            )

    try:
        doc = yaml_rs.loads(text)
    except yaml_rs.YAMLDecodeError as e:
        msg = str(e)
        m = _LINE_COL.search(msg)
        if m:
            reason = msg.strip().splitlines()[-1]
            raise InputError(f"YAML syntax error: {reason}", f"{filename}:{m[1]}:{m[2]}") from None
        if msg.startswith("duplicate mapping key"):
            raise InputError(msg, loc.duplicate_key()) from None
        raise InputError(f"YAML error: {msg}", filename) from None
    except RecursionError:
        raise
    except TypeError as e:  # a mapping or a list as a mapping key: unhashable
        raise InputError(
            f"YAML error: a mapping key must be a scalar, not a mapping or a list ({e})",
            loc.complex_key(),
        ) from None
    except Exception as e:  # the parser refused the text in some other way
        raise InputError(f"YAML error: {e}", filename) from None
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
    #: where each identity is declared (its data path), for errors found later
    declared: dict[str, tuple[PathPart, ...]] = {}
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
            raise fail(
                f"unknown resource kind {kind!r} {known_kinds_hint(kinds, str(kind))}",
                ("resources", kind),
                key=True,
            )
        if items is None:
            continue
        if not isinstance(items, list):
            raise fail(f"`resources.{kind}` must be a list of resources", ("resources", kind))
        exported = _mgmt_items(cls, str(kind), items, ignored)
        try:
            # one call for the whole list: the fast path for large graphs
            built: list[Resource] = msgspec.convert(items, list[cls], strict=True)  # type: ignore[valid-type]
        except msgspec.ValidationError:
            # integers for text take their source text; else find the bad one and say where
            built = [
                _build(cls, str(kind), it, ("resources", kind, i), fail, loc)
                for i, it in enumerate(items)
            ]
        for i, res in enumerate(built):
            if not res.name:
                raise fail(
                    f"{kind} resource without a `name:` (a non-empty string)",
                    ("resources", kind, i),
                )
            if i in exported and _collected_here(res, model.collect):
                # mgmt's exporter collects its own export too: applied here as well
                res = msgspec.structs.replace(
                    res, meta=msgspec.structs.replace(res.meta, hidden=False)
                )
            try:
                model.add(res)
            except InputError as e:
                raise InputError(e.message, loc.at(("resources", kind, i))) from None
            declared.setdefault(res.ident, ("resources", kind, i))
    edges = doc.get("edges") or []
    if not isinstance(edges, list):
        raise fail("`edges` must be a list", ("edges",))
    for i, item in enumerate(edges):
        edge = _edge(item, ("edges", i), fail, registry)
        try:
            model.connect(edge)
        except InputError as e:
            raise InputError(e.message, loc.at(("edges", i))) from None
    for group, count in warned.items():
        if warn and count > WARN_EACH:
            log.warning("%s: %s: %d more ignored the same way", filename, group, count - WARN_EACH)
    try:
        model.check(valid)
    except GraphCycleError as e:
        # Point at the edge that closes the cycle.
        closing = (e.cycle[-2], e.cycle[-1])
        idx = next((i for i, ed in enumerate(model.edges) if (ed.from_id, ed.to_id) == closing), 0)
        raise InputError(e.message, loc.at(("edges", idx))) from None
    except InputError as e:
        raise InputError(e.message, _where_resource(e.where, declared, loc) or filename) from None
    return model


def _did_you_mean(word: object, choices: tuple[str, ...]) -> str:
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
    loc: _Locator,
) -> Resource:
    """One resource. An integer given where text is wanted takes its source text,
    as mgmt's reader hands it over (`mode: 0741` is "0741", not 741)."""
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
    item: object, sub: tuple[PathPart, ...], where: tuple[PathPart, ...], loc: _Locator
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


def _where_resource(where: str, declared: dict[str, tuple[PathPart, ...]], loc: _Locator) -> str:
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
        #: the last graph's resources, as validated (`GraphModel.validated`)
        self._valid: dict[str, Resource] = {}
        #: the exports the running graph was built with, and the specs that found them
        self._found: list[Exported] = []
        self._specs: list[CollectSpec] = []

    def load(self) -> GraphModel:
        """Parse the file now (InputError)."""
        text = read_graph_file(self.path)
        model = parse_yaml(text, str(self.path), self.registry)
        self._text, self._valid = text, model.validated()
        return model

    def graph_file(self) -> Path:
        return self.path

    def preload(self) -> None:
        if self._raw is None:
            self._raw = self.load()

    async def first(self, ctx: Context) -> GraphModel:
        raw, self._raw = self._raw or self.load(), None
        self._specs = list(raw.collect)
        if raw.collect and ctx.collector is not None:
            self._found = matching(await ctx.collected(), raw.collect)
            return merge(raw, to_resources(self.registry, self._found))
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
                        raw = parse_yaml(payload, str(self.path), self.registry, valid=self._valid)
                    except InputError as e:
                        log.error("%s (the running graph is kept)", e)
                        continue
                    self._text, self._valid = payload, raw.validated()
                    log.info("%s changed: swapping the graph live", self.path)
                else:
                    raw = parse_yaml(
                        self._text, str(self.path), self.registry, warn=False, valid=self._valid
                    )
                now = matching(collector.current(), raw.collect) if collector else []
                if what == "collected":
                    if now == self._found:
                        continue  # a change this graph does not collect
                    log.info("collected exports changed: swapping the graph live")
                self._found = now
                yield merge(raw, to_resources(self.registry, now))
        finally:
            if unlisten is not None:
                unlisten()
