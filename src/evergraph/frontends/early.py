"""A large YAML graph's `resources:` parsed by a helper forked as `evergraph run`
starts (issue 28).

A one-shot run of W1's 10k files spends its first ~100 ms importing its modules
on one core, then ~60-100 ms in the YAML parser, on the same core, while the
other waits. Here `start` (the console script, before its imports) forks a
helper that reads the graph file, parses its `resources:` section alone (and
reads its explicit edges in mgmt's layout, `yaml_edges.cut_edges`), and leaves
the bytes' SHA-256, where the section's lines are, the section's value and the
edges (`marshal`) in a memfd, then exits. The YAML frontend takes it
(`take`) only for the very bytes it read itself (the same SHA-256), and then
parses the rest of the text (the graph's name, its edges, `collect:`) with the
section's lines cut out, and puts the helper's value under `resources`:
W1's document costs the parent ~15 ms of `marshal.loads` instead of its parse.

Sure or not at all. The section is cut as `yaml_layout.resources_section`
finds it (one `resources:` key alone on its line at column 0, to the next line
at column 0 that is not a comment; no CR, tab at a line's start, directive, nor
possible alias anywhere, so that no anchor's value crosses the cut); the
helper's text is the section, then, unless the section ends the file, one more
top-level key (a block scalar at the section's end reads as it does in the
whole file: not at the end of a text). Its document must be that key and
`resources` alone; the parent's, with the section's lines cut out, must hold
`resources` with nothing under it. Its data must be what `marshal` carries
exactly (a date or a timestamp: it gives up). Otherwise, and on any error,
the whole text is parsed as before: errors and warnings are a whole parse's,
and name `file:line:col` in the whole file.

The helper has no effect: it reads the file and writes its memfd, logs
nothing, and ignores Ctrl-C (its parent's to handle). A frontend that does not
take it (a parse cache hit, an error) kills and reaps it (`drop`); a run that
exits first leaves it to finish on its own, in ~0.1 s. It parses nothing for a
file the parse cache holds (`RECENT`): that run takes its model from the cache.
It is forked only from a process with one thread and two cores or more to run
on, for a `.yaml`/`.yml` file of `EARLY_MIN` bytes or more.
"""

from __future__ import annotations

import contextlib
import marshal
import os
import signal
import stat
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from evergraph.frontends.yaml_layout import may_alias, resources_section

if TYPE_CHECKING:
    from evergraph.frontends.yaml_edges import Cut

#: graph files smaller than this are parsed by the run alone (the fork and the
#: hand-back cost about what the helper saves)
EARLY_MIN = 512 << 10
#: files the helper is forked for
SUFFIXES = (".yaml", ".yml")
#: the top-level key after the section in the helper's text (see the docstring)
AFTER = "evergraph-after-resources"
#: bytes the helper reads at most (the frontend refuses more: base.MAX_GRAPH_FILE)
READ_MAX = 256 << 20
#: the parse cache's directory, under the state (or the user's cache) directory
CACHE_SUBDIR = "parse-cache"
#: in it, the SHA-256 of the large files its entries were parsed from (a line
#: each, hex, the last few: cache.py writes it): the helper parses none of those,
#: whose run takes its model from the cache (a stale line costs that run the
#: helper's help, nothing else)
RECENT = "recent"
#: bytes of it read at most
RECENT_MAX = 16 << 10

#: what the helper made of a text: where its `resources:` section's lines begin,
#: where they end (the line after them), the section's value, and its explicit
#: edges as `yaml_edges.cut_edges` reads them (None: it does not)
Early = tuple[int, int, Any, "Cut | None"]

#: the helper forked (its pid, its memfd), until taken or dropped
_helper: tuple[int, int] | None = None
#: work the parent does if it has to wait for the helper (`meanwhile`)
_meanwhile: list[Callable[[], object]] = []


def cache_dir(state_dir: str | None) -> str:
    """The parse cache's directory for a run with `state_dir` (None: the default)."""
    if state_dir is not None:
        return os.path.join(state_dir, CACHE_SUBDIR)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(base, "evergraph", CACHE_SUBDIR)


def _state_dir(args: list[str]) -> str | None:
    """`--state-dir`'s value among `run`'s `args` (the last given), or None."""
    found = None
    for i, arg in enumerate(args):
        if arg == "--state-dir" and i + 1 < len(args):
            found = args[i + 1]
        elif arg.startswith("--state-dir="):
            found = arg.partition("=")[2]
    return found


def start(args: list[str]) -> None:
    """The console script's `run ARGS`: fork the helper for the one `.yaml` file
    among `args` if it is large enough, else nothing."""
    global _helper
    files = [a for a in args if a.endswith(SUFFIXES) and not a.startswith("-")]
    if _helper is not None or len(files) != 1 or len(os.sched_getaffinity(0)) < 2:
        return
    threading = sys.modules.get("threading")
    if threading is not None and threading.active_count() > 1:
        return  # (a fork keeps one thread: a lock another held stays held in the child)
    try:
        if os.stat(files[0]).st_size < EARLY_MIN:
            return
        out = os.memfd_create("evergraph-early-parse", os.MFD_CLOEXEC)
    except OSError:
        return
    # loaded before the fork, not by the helper: the run needs them too (the parser
    # for the rest of the text, the hash for the cache and `take`)
    import hashlib  # noqa: F401

    from evergraph.frontends import _yaml_rs, yaml_edges  # noqa: F401

    try:
        pid = os.fork()
    except OSError:
        os.close(out)
        return
    if pid == 0:  # pragma: no cover (the helper: measured through what it hands back)
        status = 1
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            status = _help(files[0], out, cache_dir(_state_dir(args)))
        finally:
            os._exit(status)
    _helper = (pid, out)


def meanwhile(work: Callable[[], object]) -> None:
    """`work` for `take` to do if the helper is still parsing when it is called (the
    agent's modules, loaded then rather than later); dropped unrun if it is not, or
    if the helper is not taken (a parse cache hit)."""
    if _helper is not None:
        _meanwhile.append(work)


def take(data: bytes) -> Early | None:
    """What the helper made of `data` (`Early`), waiting for it; None: no helper, or it parsed
    other bytes, or it gave up. The helper is reaped either way."""
    global _helper
    helper, _helper = _helper, None
    if helper is None:
        return None
    pid, out = helper
    work, _meanwhile[:] = list(_meanwhile), []
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
        if not done:
            for step in work:
                with contextlib.suppress(Exception):  # (it fails again where it is due)
                    step()
            _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            return None
        got = marshal.loads(os.pread(out, os.fstat(out).st_size, 0))
    except (OSError, EOFError, ValueError, TypeError):
        return None
    finally:
        os.close(out)
    if type(got) is not tuple or len(got) != 5:
        return None
    digest, begin, end, value, edges = got
    import hashlib

    if digest != hashlib.sha256(data).digest():
        return None
    return begin, end, value, edges


def drop() -> None:
    """The helper not taken: killed if still there, and reaped."""
    global _helper
    helper, _helper = _helper, None
    _meanwhile.clear()
    if helper is not None:
        pid, out = helper
        os.close(out)
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def _known(cache: str, digest: str) -> bool:
    """Whether `digest` is in the parse `cache`'s `RECENT` (never waited on: a
    FIFO there is no file)."""
    try:
        fd = os.open(
            os.path.join(cache, RECENT), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        )
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        return digest in os.read(fd, RECENT_MAX).decode("ascii", "replace").split()
    finally:
        os.close(fd)


def parse_section(text: str) -> Early | None:
    """The helper's parse of `text` (`Early`), or None: the
    text does not cut there for certain, or the section does not parse."""
    section = None if may_alias(text) else resources_section(text)
    if section is None:
        return None
    at, line_end, end = section
    # (here, not with the module: the console script loads it for every `run`;
    # `start` loads it before it forks a helper)
    from evergraph.frontends import _yaml_rs as yaml_rs

    ends_text = end == len(text) - 1
    doc = yaml_rs.loads(text[at : end + 1] + ("" if ends_text else f"{AFTER}: 0\n"))
    if type(doc) is not dict or list(doc) != (["resources"] if ends_text else ["resources", AFTER]):
        return None
    if not ends_text and (type(doc[AFTER]) is not int or doc[AFTER] != 0):
        return None
    from evergraph.frontends.yaml_edges import cut_edges

    return line_end + 1, end + 1, doc["resources"], cut_edges(text)


def _help(path: str, out: int, cache: str) -> int:  # pragma: no cover (the helper's)
    """Read `path`, parse its section, write what `take` reads to `out`: 0 if done;
    2: not parsed, the parse `cache` holds these bytes' model."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        return 1  # (a FIFO put there since: never waited on)
    chunks = []
    size = 0
    while chunk := os.read(fd, READ_MAX + 1 - size):
        chunks.append(chunk)
        size += len(chunk)
        if size > READ_MAX:
            return 1
    data = b"".join(chunks)
    import hashlib

    digest = hashlib.sha256(data)
    if _known(cache, digest.hexdigest()):
        return 2
    got = parse_section(data.decode("utf-8"))
    if got is None:
        return 1
    view = memoryview(marshal.dumps((digest.digest(), *got)))
    while view:
        view = view[os.write(out, view) :]
    return 0
