"""The YAML frontend's parse cache (issue 28): a one-shot run of a graph file
it has read before takes the model from here instead of parsing the YAML again
(W1's 10k-resource file: ~110-150 ms of parsing and building, against ~15 ms
to read and decode an entry).

An entry is named by the sha256 of everything its model depends on: the
file's exact bytes (the bytes parsed: read once, hashed and decoded, so no
edit can fall between the hash and the parse), its name (warnings and errors
name it), evergraph's version, Python's cache tag, the source of the modules
that parse and build (a development tree changes them without a new
version), and the registry's kinds (their names and modules). A stale entry
is impossible by construction: no mtime or size is involved, and an entry
whose content would differ has another name. The entry also names the class
of each kind it holds with a digest of its modules' source; a mismatch (a
kind's code changed) makes it a miss.

What is cached is the model as the YAML frontend builds it (resources with
their parameters in declaration order, explicit edges with notify and
send/recv, `collect:` specs, the graph's name, the warnings given), and the
automatic edges `prepare` will add to it (`autoedge.automatic_edges`: for
graphs whose kinds' keys are their parameters alone, without `collect:`).

What a hit trusts, and why. Each entry starts with its MAC (HMAC-SHA256)
under the cache's own secret (`KEY_NAME` in the directory: 32 random bytes,
0600, made with the first entry), so an entry is used only if this cache wrote
it: one planted by anyone who cannot read the secret, or corrupt, or torn, is
a miss. And this cache writes an entry only after a parse that succeeded, only
if it decodes back to an equal model and the same automatic edges. So the
entry's model is what a parse of these bytes made with this code (the key),
and whatever is a function of the model alone was right when the parse
checked it: a run that takes one graph (a one-shot run) checks again only the
resources the entry says `validate` gave state (it may read the machine),
and takes the claims, the meta, the acyclicity and the automatic edges as
the parse found them (automatic edges that name no resource of the graph or
are not plain automatic edges are found anew all the same). A run that follows
the file checks the whole model again, for the claims a live edit compares
with (a look-up per edge for the acyclicity when the declaration order is
topological). A hit that fails its check is dropped and the file parsed:
errors are never cached, and always name `file:line:col` as the parse does.

Entries live in one directory (0700) as files (0600) written with the project's
atomic write (without fsync: a torn entry after a power cut fails its MAC: a
miss). They are used only when the directory, the entry and the secret are ours
(our uid, not group- or other-writable, no symlink; the secret readable by no
one else): a local user must not plant a model. A corrupt or truncated entry is
a miss (parsed anew, rewritten), never an error. The directory is bounded
(MAX_BYTES, MAX_ENTRIES): after a write the least recently used entries go.

Python graphs are not cached: `def graph(g, world)` runs code, which may read
other files, the environment, the World or the clock; the file's bytes do not
determine its graph.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import importlib.machinery
import itertools
import logging
import os
import stat
import sys
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any, TypeVar, cast

import msgspec

from evergraph._util.atomic import atomic_write, is_temp, make_dirs
from evergraph._util.gc import gc_paused
from evergraph._version import __version__
from evergraph.engine.autoedge import automatic_edges
from evergraph.engine.contract import DEFAULT_META, Registry, Resource
from evergraph.engine.model import AutoEdges, CollectSpec, Edge, GraphModel
from evergraph.frontends import early

log = logging.getLogger("evergraph.frontend.cache")

#: the entry layout; a new one makes every old entry a miss (3: a resource's
#: fields at their defaults are left out; 4: the MAC first)
FORMAT = "4"
#: what the cache directory may hold (a 10k-resource graph's entry is ~4 MB)
MAX_BYTES = 64 * 1024 * 1024
MAX_ENTRIES = 32
#: the largest entry read
MAX_ENTRY = 128 * 1024 * 1024
#: the subdirectory of the state (or cache) directory
SUBDIR = early.CACHE_SUBDIR
#: the cache's secret, in its directory: each entry starts with its MAC under it
KEY_NAME = ".key"
KEY_SIZE = 32
MAC_SIZE = 32  # (HMAC-SHA256's)
#: the modules whose code makes a YAML graph's model (their source is in the key)
_MAKERS = (
    "evergraph._version",
    "evergraph.engine.autoedge",
    "evergraph.engine.build",
    "evergraph.engine.contract",
    "evergraph.engine.model",
    "evergraph.frontends.base",
    "evergraph.frontends.cache",
    "evergraph.frontends.collect",
    "evergraph.frontends.yaml",
    "evergraph.frontends.yaml_edges",
    "evergraph.frontends.yaml_entries",
    "evergraph.frontends.yaml_load",
)
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_ENTRY = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


class _Kind(msgspec.Struct, array_like=True):
    """A kind an entry holds: its registered name, and its class's code."""

    kind: str
    code: str


class _Entry(msgspec.Struct, array_like=True):
    key: str
    name: str
    kinds: list[_Kind]
    #: consecutive resources of one kind: (index into `kinds`, a list of them)
    runs: list[tuple[int, msgspec.Raw]]
    edges: list[Edge]
    collect: list[CollectSpec]
    #: the warnings the parse gave, as logged
    notes: list[str]
    #: resources `validate` gave state of their own: validated again on a hit
    stateful: list[str]
    #: the automatic edges `prepare` adds to the model (None: not known in advance)
    auto: AutoEdges | None = None


_encoder = msgspec.msgpack.Encoder()
_entry_decoder = msgspec.msgpack.Decoder(_Entry)
_decoders: dict[type[Resource], msgspec.msgpack.Decoder[Any]] = {}
#: a kind's fields, as `_slim` reads them: (attribute, encoded name, default,
#: default factory)
_fields: dict[type[Resource], list[tuple[str, str, Any, Any]]] = {}
#: module name -> digest of its source (computed once per process)
_digests: dict[str, str] = {}


def _source_path(name: str) -> str | None:
    """The file of module `name`, imported or not: the parser's modules load with
    the first parse only, and a run whose model is cached never imports them."""
    module = sys.modules.get(name)
    if module is not None:
        return getattr(module, "__file__", None)
    parent = sys.modules.get(name.rpartition(".")[0])
    spec = importlib.machinery.PathFinder.find_spec(name, getattr(parent, "__path__", None))
    return None if spec is None else spec.origin


def _module_digest(name: str) -> str:
    got = _digests.get(name)
    if got is None:
        path = _source_path(name)
        data = b"?"
        if path:
            try:
                data = Path(path).read_bytes()
            except OSError:
                data = b"?"
        got = _digests[name] = hashlib.sha256(data).hexdigest()
    return got


def _class_code(cls: type[Resource]) -> str:
    """The class's identity and the source of every module of its resource bases."""
    parts = [f"{cls.__module__}.{cls.__qualname__}"]
    for base in cls.__mro__:
        if isinstance(base, type) and issubclass(base, Resource):
            parts.append(_module_digest(base.__module__))
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def entry_key(data: bytes, filename: str, registry: Registry) -> str:
    """The name of the entry for a graph file's bytes `data` read from `filename`."""
    h = hashlib.sha256()
    # (a kind's origin: the same whether its module was imported yet or not, so
    # that the first parse of a process, which imports it, keys as the next)
    kinds = [f"{k}={registry.origin(k)}" for k in registry.kinds()]
    head = [
        "evergraph parse cache",
        FORMAT,
        __version__,
        sys.implementation.cache_tag or "",
        *(_module_digest(m) for m in _MAKERS),
        *kinds,
        filename,
    ]
    h.update("\0".join(head).encode("utf-8", "surrogateescape"))
    h.update(b"\0\0")
    h.update(data)
    return h.hexdigest()


def default_dir(state_dir: Path | None) -> Path:
    """Under the state directory, else the user's cache directory (XDG)."""
    return Path(early.cache_dir(None if state_dir is None else str(state_dir)))


def _ours(st: os.stat_result) -> bool:
    """Owned by us and writable by no one else."""
    return st.st_uid == os.geteuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


class ParseCache:
    """Models of YAML graph files by `entry_key`, in `directory`."""

    def __init__(self, directory: Path, within: Path | None = None) -> None:
        self.directory = directory
        #: a directory the cache never creates (the state dir: a run refused for bad
        #: input leaves none behind; the agent makes it once it starts)
        self.within = within
        #: an entry `put` made before `within` existed: (key, its bytes), for `flush`
        self._pending: tuple[str, bytes] | None = None
        self._later: tuple[str, GraphModel, list[str], Registry] | None = None
        #: that entry's encoding, under way (`encode_later` stopped by its `until`)
        self._steps: Generator[None, None, tuple[str, bytes] | None] | None = None
        #: the bytes the entry `put` keeps was parsed from (`early.RECENT`)
        self._source: bytes | None = None

    def _open_dir(self) -> int | None:
        """The directory, open, if it is ours (else None: not used)."""
        try:
            fd = os.open(self.directory, _OPEN_DIR)
        except OSError:
            return None
        if not _ours(os.fstat(fd)):
            os.close(fd)
            log.warning(
                "%s: not used as a parse cache: not owned by this user or writable by others",
                self.directory,
            )
            return None
        return fd

    def get(
        self, key: str, registry: Registry, warn: bool = True, keep: bool = True
    ) -> GraphModel | None:
        """The model of entry `key`, checked (warnings given again if `warn`); None
        if there is none to use (absent, not ours, corrupt, or failing its check).
        `keep`: its check keeps the claims for `validated()` (a live edit's re-check;
        a run that takes no later graph needs none)."""
        dfd = self._open_dir()
        if dfd is None:
            return None
        try:
            data = self._read(dfd, key)
            secret = self._secret(dfd) if data is not None else None
        finally:
            os.close(dfd)
        if data is None:
            return None
        body = memoryview(data)[MAC_SIZE:]
        if secret is None or not _same(data[:MAC_SIZE], _mac(secret, body)):
            log.debug("%s/%s: parse cache entry not used: not this cache's", self.directory, key)
            return None
        with gc_paused():
            try:
                entry, model = decode(body, registry)
            except Exception as e:  # of other code: parse anew
                log.debug("%s/%s: parse cache entry not used: %s", self.directory, key, e)
                return None
            if entry.key != key:
                return None
            try:
                if keep:
                    model.check(keep=True, stateful=frozenset(entry.stateful))
                else:  # (what is not a function of the model alone: see the docstring)
                    for ident in entry.stateful:
                        model.resources[ident].validate()
            except Exception as e:  # the parse gives the error, where it is
                log.debug("%s/%s: cached model fails its check: %s", self.directory, key, e)
                return None
            auto = entry.auto
            if auto is not None and not keep and _plain_auto(auto, model):
                model.auto = auto  # (a run that takes later graphs finds its own)
        if warn:
            for note in entry.notes:
                log.warning("%s", note)
        return model

    def _secret(self, dfd: int, make: bool = False) -> bytes | None:
        """The cache's secret (`KEY_NAME`), if it is ours and no one else may read it;
        with `make`, one is made if there is none to use."""
        secret = self._read(dfd, KEY_NAME, secret=True)
        if secret is not None and len(secret) == KEY_SIZE:
            return secret
        if not make:
            return None
        secret = os.urandom(KEY_SIZE)  # (two writers at once: the last one's stays)
        atomic_write(KEY_NAME, secret, mode=0o600, dir_fd=dfd, durable=False)
        return secret

    def _read(self, dfd: int, key: str, secret: bool = False) -> bytes | None:
        """File `key`'s bytes if it is ours (`secret`: and no one else may read it)."""
        try:
            fd = os.open(key, _OPEN_ENTRY, dir_fd=dfd)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or not _ours(st) or st.st_size > MAX_ENTRY:
                return None
            if secret and st.st_mode & 0o077:
                return None
            chunks = []
            while chunk := os.read(fd, 1 << 22):
                chunks.append(chunk)
            if not secret:
                with contextlib.suppress(OSError):
                    os.utime(fd)  # recently used: pruned last
            return b"".join(chunks)
        except OSError:
            return None
        finally:
            os.close(fd)

    def put(
        self,
        key: str,
        model: GraphModel,
        notes: list[str],
        registry: Registry,
        later: bool = False,
        source: bytes | None = None,
    ) -> None:
        """Keep `model` (as its parse returned it, checked) as entry `key`; quietly
        nothing if it cannot be encoded exactly or written. `source`: the bytes
        parsed, whose hash the entry's write notes for the early parse (a large
        file's: `early.RECENT`). Before `within` exists
        (a run's first parse, before the agent makes its state dir) the entry is
        encoded now (the model is changed once it runs) and written by `flush`.
        `later`: encoded by `flush` too (which the caller calls before anything
        changes the model: a one-shot run's parse, whose work ahead starts first)."""
        self._source = source
        if later:
            with gc_paused():
                model.auto = _auto_of(model)  # (now: the work ahead reads them)
            self._later = (key, model, notes, registry)
            return
        if self.within is not None and not self.within.is_dir():
            data = self._encoded(key, model, notes, registry)
            self._pending = (key, data) if data is not None else None
            return
        data = self._encoded(key, model, notes, registry)
        if data is not None:
            self._write(key, data)

    def holds_later(self) -> bool:
        """An entry `put` was told to keep `later` waits for `flush`."""
        return self._later is not None

    def drop_later(self) -> None:
        """Forget that entry: another process (a child forked with the same model
        and cache, engine/ahead.py) flushes it."""
        self._later = self._steps = None

    def flush(self) -> None:
        """Encode the entry `put` was told to keep `later`, and write the entry held
        back because `within` did not exist yet (the agent calls this once it has
        made its state dir; kept for a later call if still absent)."""
        self.encode_later()
        self.write_held()

    def encode_later(self, until: Callable[[], bool] | None = None) -> bool:
        """`flush`'s first half, CPU alone: the entry `put` was told to keep `later`
        encoded and held for `write_held`; whether that is done. `until`: asked
        before each step (`STEP` resources, a few milliseconds): once it says True
        the work stops there, and the next call goes on from there. A child ahead
        encodes the entry while it waits for the engine's go, and no longer: the go
        stops it, the child makes its part, then finishes it and writes it
        (engine/ahead.py)."""
        steps = self._steps
        if steps is None:
            later, self._later = self._later, None
            if later is None:
                return True
            steps = self._steps = self._encoding(*later)
        with gc_paused():
            while until is None or not until():
                try:
                    next(steps)
                except StopIteration as done:
                    self._steps = None
                    if done.value is not None:
                        self._pending = done.value
                    return True
        return False

    def write_held(self) -> None:
        """`flush`'s second half: the entry held written, once `within` exists."""
        pending = self._pending
        if pending is not None and (self.within is None or self.within.is_dir()):
            self._pending = None
            self._write(*pending)

    def _encoded(
        self, key: str, model: GraphModel, notes: list[str], registry: Registry
    ) -> bytes | None:
        """Entry `key`'s bytes, if they decode back to an equal model. The automatic
        edges found for it are the model's too (`GraphModel.auto`: its `prepare`
        takes them instead of finding them again)."""
        with gc_paused():
            got = _finished(self._encoding(key, model, notes, registry))
        return None if got is None else got[1]

    def _encoding(
        self, key: str, model: GraphModel, notes: list[str], registry: Registry
    ) -> Generator[None, None, tuple[str, bytes] | None]:
        """`_encoded`, in steps: (key, bytes), or None. (The caller pauses the
        collector: a step makes thousands of objects.)"""
        try:
            auto = model.auto = _auto_of(model)
            data = yield from encoding(key, model, notes, auto)
            yield
            entry, back = yield from decoding(data, registry)
            same = yield from comparing(back, model)
            if not same or entry.auto != auto:
                log.debug("%s: not cached: the model does not encode exactly", key)
                return None
        except Exception as e:  # a cache never fails a run
            log.debug("%s/%s: not cached: %s", self.directory, key, e)
            return None
        return key, data

    def _write(self, key: str, data: bytes) -> None:
        try:
            make_dirs(self.directory, 0o700)
        except OSError as e:
            log.debug("%s: no parse cache: %s", self.directory, e)
            return
        dfd = self._open_dir()
        if dfd is None:
            return
        try:
            secret = self._secret(dfd, make=True)
            assert secret is not None
            atomic_write(key, _mac(secret, data) + data, mode=0o600, dir_fd=dfd, durable=False)
            self._prune(dfd, key)
            source, self._source = self._source, None
            if source is not None and len(source) >= early.EARLY_MIN:
                _remember(dfd, hashlib.sha256(source).hexdigest())
        except Exception as e:  # a cache never fails a run
            log.debug("%s/%s: not cached: %s", self.directory, key, e)
        finally:
            os.close(dfd)

    def _prune(self, dfd: int, keep: str) -> None:
        """Remove the least recently used entries beyond MAX_ENTRIES and MAX_BYTES
        (and temporary files a kill left, once a minute old)."""
        found: list[tuple[float, int, str]] = []
        for name in os.listdir(dfd):
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except OSError:
                continue
            if name in (KEY_NAME, early.RECENT):
                continue
            if is_temp(name):
                if st.st_mtime < _now() - 60:
                    with contextlib.suppress(OSError):
                        os.unlink(name, dir_fd=dfd)
                continue
            if name != keep:
                found.append((st.st_mtime, st.st_size, name))
        found.sort(reverse=True)  # the newest first
        total = 0
        for i, (_, size, name) in enumerate(found):
            total += size
            if i + 1 >= MAX_ENTRIES or total > MAX_BYTES:
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=dfd)


def _remember(dfd: int, digest: str) -> None:
    """`digest` last in `early.RECENT` (in the directory `dfd`), which keeps the last
    MAX_ENTRIES of them: the early parse leaves those files to the cache."""
    try:
        fd = os.open(early.RECENT, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
    except FileNotFoundError:
        known = []
    else:
        try:
            known = os.read(fd, early.RECENT_MAX).decode("ascii", "replace").split()
        finally:
            os.close(fd)
    others = [d for d in known if d != digest]
    kept = [*others[-(MAX_ENTRIES - 1) :], digest]
    data = ("\n".join(kept) + "\n").encode()
    atomic_write(early.RECENT, data, mode=0o600, dir_fd=dfd, durable=False)


def _mac(secret: bytes, data: bytes | memoryview) -> bytes:
    # (OpenSSL's one-shot HMAC: 1.6 MB in ~1.6 ms here, keyed BLAKE2b's ~3.8)
    return hmac.digest(secret, data, "sha256")


def _same(a: bytes, b: bytes) -> bool:
    return hmac.compare_digest(a, b)  # (in constant time)


def _now() -> float:
    import time

    return time.time()


def _auto_of(model: GraphModel) -> AutoEdges | None:
    """`model.auto` if found already for it as it is (`put(later=True)`), else found."""
    auto = model.auto
    return auto if auto is not None and auto.fits(model) else automatic_edges(model)


def _plain_auto(auto: AutoEdges, model: GraphModel) -> bool:
    """Automatic edges as `automatic_edges` makes them, between the model's resources."""
    res = model.resources
    # (by index: a NamedTuple's fields by name cost more)
    return auto.fits(model) and all(
        e[0] in res and e[1] in res and e[2:] == _AUTO_TAIL for e in auto.edges
    )


#: what follows the two ends of an automatic edge: no notify, send or recv; "auto"
_AUTO_TAIL = Edge("", "", name="auto")[2:]


def encode(key: str, model: GraphModel, notes: list[str], auto: AutoEdges | None = None) -> bytes:
    """An entry of `model` (resources' fields only: state `validate` set is not kept)
    and of its automatic edges `auto` (`automatic_edges(model)`)."""
    return _finished(encoding(key, model, notes, auto))


T = TypeVar("T")

#: resources made slim in one step of `encoding`, or compared in one of `comparing` (W1's
#: files: ~2 ms)
STEP = 1024


def encoding(
    key: str, model: GraphModel, notes: list[str], auto: AutoEdges | None = None
) -> Generator[None, None, bytes]:
    """`encode` in steps: a step (a yield) after each `STEP` resources made slim,
    and after each run of a kind encoded (the entry is the one an encode at once
    makes: a run a kind, a hit's decode as quick)."""
    kinds: list[_Kind] = []
    index: dict[type[Resource], int] = {}
    runs: list[tuple[int, msgspec.Raw]] = []
    run: list[Resource] = []
    slim: list[dict[str, Any]] = []  # the run's resources made slim so far
    run_cls: type[Resource] | None = None

    def flush() -> None:
        if run_cls is not None and (run or slim):
            slim.extend(_slim(run_cls, run))
            runs.append((index[run_cls], msgspec.Raw(_encoder.encode(slim))))

    stateful: list[str] = []
    for ident, res in model.resources.items():
        cls = type(res)
        if ident != res.ident:
            raise ValueError(f"{ident} is held under another name")
        if cls is not run_cls:
            flush()
            if run or slim:
                yield
            run, slim, run_cls = [], [], cls
            if cls not in index:
                index[cls] = len(kinds)
                kinds.append(_Kind(cls.kind, _class_code(cls)))
        elif len(run) >= STEP:
            slim.extend(_slim(cls, run))
            run = []
            yield
        run.append(res)
        if res.__dict__:
            stateful.append(ident)
    flush()
    yield
    entry = _Entry(
        key=key,
        name=model.name,
        kinds=kinds,
        runs=runs,
        edges=model.edges,
        collect=model.collect,
        notes=notes,
        stateful=stateful,
        auto=auto,
    )
    return _encoder.encode(entry)


def _finished(steps: Generator[None, None, T]) -> T:
    """What `steps` returns, all its steps taken at once."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return cast(T, done.value)


def _slim(cls: type[Resource], run: list[Resource]) -> list[dict[str, Any]]:
    """`run`'s resources as maps without the fields at their defaults (of the
    default's own type: a 0.0 where the default is 0 is kept), which a decode
    gives back as they are: a File's ~20 fields (its meta's ~17) are mostly
    defaults, and decoding them was ~half of a hit's decode (W1 10k: an entry of
    1.5 MB instead of 3.8). Missing, `meta` decodes as the shared DEFAULT_META
    itself, as the parse leaves it."""
    fields = _fields.get(cls)
    if fields is None:
        fields = _fields[cls] = [
            (f.name, f.encode_name, f.default, f.default_factory)
            for f in msgspec.structs.fields(cls)
        ]
    nodefault = msgspec.NODEFAULT
    # each field's encoded name and default (a factory's: one made for comparing;
    # a required field's: nothing a value is)
    pairs = [
        (
            key,
            default
            if default is not nodefault
            else factory()
            if factory is not nodefault
            else _REQUIRED,
        )
        for _, key, default, factory in fields
    ]
    astuple = msgspec.structs.astuple
    return [
        {
            key: value
            for (key, default), value in zip(pairs, astuple(res), strict=True)
            if not (value is default or (type(value) is type(default) and value == default))
        }
        for res in run
    ]


#: the default of a field without one: no value is it, or of its type
_REQUIRED = object()


def decode(data: bytes | memoryview, registry: Registry) -> tuple[_Entry, GraphModel]:
    """An entry and its model (unchecked); raises on anything amiss. The kinds'
    classes in `registry` must be those the entry was made with."""
    return _finished(decoding(data, registry))


def decoding(
    data: bytes | memoryview, registry: Registry
) -> Generator[None, None, tuple[_Entry, GraphModel]]:
    """`decode` in steps: a step after the entry's head, then one a run."""
    entry = _entry_decoder.decode(data)
    yield
    reg = registry
    classes: list[type[Resource]] = []
    for k in entry.kinds:
        cls = reg.get(k.kind)
        if cls is None or cls.kind != k.kind or _class_code(cls) != k.code:
            raise ValueError(f"kind {k.kind!r} is not the one the entry was made with")
        classes.append(cls)
    resources: dict[str, Resource] = {}
    default = DEFAULT_META
    for i, raw in entry.runs:
        cls = classes[i]
        dec = _decoders.get(cls)
        if dec is None:
            dec = _decoders[cls] = msgspec.msgpack.Decoder(list[cls])  # type: ignore[valid-type]
        # `res.ident`, without a property call and a format per resource (where the
        # kind keeps Resource's)
        head = f"{cls.kind}[" if cls.ident is Resource.ident else None
        for res in dec.decode(raw):
            meta = res.meta
            if meta is not default and meta == default:
                res.meta = default  # as the parse leaves it: one shared default
            resources[head + res.name + "]" if head is not None else res.ident] = res
        yield
    model = GraphModel(
        name=entry.name, resources=resources, edges=entry.edges, collect=entry.collect
    )
    return entry, model


def same_model(a: GraphModel, b: GraphModel) -> bool:
    """Equal names, resources (in order, of the same classes), edges, collect specs
    and origins (an entry keeps none: a model with some is not cached)."""
    return _finished(comparing(a, b))


def comparing(a: GraphModel, b: GraphModel) -> Generator[None, None, bool]:
    """`same_model` in steps: a step after the graph's shape, then one every
    `STEP` resources."""
    if a.name != b.name or a.edges != b.edges or a.collect != b.collect or a.origins != b.origins:
        return False
    if list(a.resources) != list(b.resources):
        return False
    yield
    pairs = zip(a.resources.values(), b.resources.values(), strict=True)
    while True:
        step = list(itertools.islice(pairs, STEP))
        if not step:
            return True
        if not all(type(x) is type(y) and x == y for x, y in step):
            return False
        yield
