"""What `evergraph deploy FILE` sends (SPEC §4.4): the bundle, and what it leaves out.

In a git work tree the bundle is the files tracked at HEAD under FILE's
directory, read from git's objects (`git ls-tree -r HEAD`, `git cat-file
--batch`), never from the work tree: an untracked file (a state dir, a local
secret) cannot ride along, and an uncommitted change to a tracked file stops
the deploy. With `--no-git` it is that directory as it is on disk.

Either way some things never go (each is reported, with the reason):

- an evergraph state dir (a directory holding `keys/box.key`, `keys/sign.key`,
  `world.sqlite`, `pins.json` or `vertices/`) and any `keys/` directory:
  private keys, sealed secrets, the World's own file;
- sockets, FIFOs and device files; `.git`;
- a file larger than the size limit (`--max-file-size`, default 10 MiB);
- what `.evergraphignore` files exclude (gitignore syntax: `#` comments,
  `!` re-includes, a trailing `/` matches directories only, a `/` elsewhere
  anchors the pattern to the file's directory, `*`, `?`, `[...]`, `**`), with
  built-in patterns first: dot entries (`.*`) and `__pycache__/`. A pattern
  applies under the directory of the file that holds it; the last match wins;
  nothing under an excluded directory is looked at again.

FILE itself always goes (named explicitly, even if a pattern matches it),
unless it is too large. At most `deploys.MAX_FILES` files and
`deploys.MAX_BYTES` bytes: more is an error, not a cut.
"""

from __future__ import annotations

import os
import posixpath
import re
import stat
import subprocess
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from evergraph.cluster import deploys as dp
from evergraph.cluster.deploys import Content, Deploy, DeployError

MAX_FILE_SIZE = 10 << 20
IGNORE_FILE = ".evergraphignore"
#: a directory holding any of these is an evergraph state dir
STATE_FILES = ("keys/box.key", "keys/sign.key", "world.sqlite", "pins.json")
STATE_DIRS = ("vertices",)
_STATE_WHY = "an evergraph state dir (keys, World, pins: never deployed)"
_KEYS_WHY = "a keys/ directory (private keys are never deployed)"


@dataclass(frozen=True, slots=True)
class LeftOut:
    #: relative to the bundle's root; a directory ends with "/"
    path: str
    why: str
    #: surprising enough to report on every deploy (a state dir, keys, a socket, a
    #: big file), not just in --dry-run (a dot file, an ignore pattern)
    notable: bool = False


@dataclass
class Bundle:
    #: the entry file, relative to `root`
    entry: str
    root: Path
    files: dict[str, Content] = field(default_factory=dict)
    left_out: list[LeftOut] = field(default_factory=list)
    #: the commit the files were read from (None with --no-git)
    git: str | None = None

    @property
    def size(self) -> int:
        return sum(len(c.data) for c in self.files.values())


def collect(path: Path, *, use_git: bool = True, max_file_size: int = MAX_FILE_SIZE) -> Bundle:
    """The bundle for `deploy FILE`; DeployError (one line) if it cannot be made."""
    if not path.name.endswith(dp.SUFFIXES):
        raise DeployError(f"{path}: a deploy's entry must be a .yaml, .yml or .py file")
    try:
        st = path.stat()
    except OSError as e:
        raise DeployError(f"{path}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise DeployError(f"{path}: not a regular file")
    b = _from_git(path, max_file_size) if use_git else _from_dir(path, max_file_size)
    dp._check_files(b.entry, list(b.files), str(b.root))
    return b


class _Limits:
    """The running totals of a bundle: MAX_FILES and MAX_BYTES are errors."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.count = 0
        self.total = 0

    def add(self, rel: str, size: int) -> None:
        self.count += 1
        self.total += size
        if self.count > dp.MAX_FILES:
            raise DeployError(
                f"{self.root}: more than {dp.MAX_FILES} files to deploy; deploy from a "
                "directory holding only the graph and its files (or list the rest in "
                f"{IGNORE_FILE})"
            )
        if self.total > dp.MAX_BYTES:
            raise DeployError(
                f"{self.root}: more than {dp.MAX_BYTES} bytes to deploy (at {rel}); deploy "
                f"from a directory holding only the graph and its files (or list the rest in "
                f"{IGNORE_FILE})"
            )


def _too_big(size: int, limit: int) -> str:
    return f"{size} bytes, over the {limit}-byte limit (--max-file-size)"


# -- ignore patterns ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Rule:
    #: the directory the pattern applies under ("" for the root)
    base: str
    regex: re.Pattern[str]
    negate: bool
    dir_only: bool
    why: str


def _translate(pat: str) -> str:
    """A gitignore glob (no leading `!`, no trailing `/`) as a regex over a path."""
    out: list[str] = []
    i, n = 0, len(pat)
    while i < n:
        c = pat[i]
        if c == "*":
            j = i
            while j < n and pat[j] == "*":
                j += 1
            whole = (i == 0 or pat[i - 1] == "/") and (j == n or pat[j] == "/")
            if j - i >= 2 and whole:
                if j == n:
                    out.append(".*")  # "a/**": everything inside
                else:
                    out.append("(?:[^/]*/)*")  # "**/": any number of directories
                    j += 1
            else:
                out.append("[^/]*")
            i = j
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[":
            cls, j = _char_class(pat, i)
            out.append(cls)
            i = j
        elif c == "\\" and i + 1 < n:
            out.append(re.escape(pat[i + 1]))
            i += 2
        else:
            out.append(re.escape(c))
            i += 1
    return "".join(out)


def _char_class(pat: str, i: int) -> tuple[str, int]:
    """The regex for the bracket expression at `pat[i] == "["` and the index after
    it; a `[` with no closing `]` is a literal."""
    j = i + 1
    negate = j < len(pat) and pat[j] in "!^"
    if negate:
        j += 1
    body: list[str] = []
    first = True
    while j < len(pat) and (pat[j] != "]" or first):
        c = pat[j]
        if c == "\\" and j + 1 < len(pat):
            body.append(re.escape(pat[j + 1]))
            j += 2
        else:
            body.append("-" if c == "-" else re.escape(c))
            j += 1
        first = False
    if j >= len(pat) or not body:
        return re.escape("["), i + 1
    inner = "".join(body)
    return (f"[^/{inner}]" if negate else f"(?!/)[{inner}]"), j + 1


def _rule(base: str, line: str, why: str) -> _Rule | None:
    line = line.rstrip("\r\n")
    if not line or line.startswith("#"):
        return None
    while line.endswith(" ") and not line.endswith("\\ "):
        line = line[:-1]
    negate = line.startswith("!")
    if negate:
        line = line[1:]
    dir_only = line.endswith("/")
    line = line.rstrip("/")
    if not line:
        return None
    # a "/" anchors the pattern to `base`; a bare name matches at any depth under it
    anchored = "/" in line
    regex = _translate(line.lstrip("/")) if anchored else "(?:[^/]*/)*" + _translate(line)
    try:
        compiled = re.compile(regex, re.DOTALL)
    except re.error:
        return None  # git ignores a pattern it cannot use; so do we
    return _Rule(base, compiled, negate, dir_only, why)


class Ignore:
    """Gitignore-style patterns from `.evergraphignore` files, built-ins first."""

    def __init__(self) -> None:
        self.rules: list[_Rule] = []
        for pattern, why in ((".*", "a dot entry"), ("__pycache__/", "a Python cache")):
            r = _rule("", pattern, why)
            assert r is not None
            self.rules.append(r)

    def add(self, base: str, text: str) -> None:
        """The patterns in the ignore file of directory `base` ("" for the root)."""
        name = f"{base}/{IGNORE_FILE}" if base else IGNORE_FILE
        for lineno, line in enumerate(text.splitlines(), 1):
            r = _rule(base, line, f"ignored by {name}:{lineno} ({line.strip()})")
            if r is not None:
                self.rules.append(r)

    def _match(self, rel: str, is_dir: bool) -> str | None:
        for r in reversed(self.rules):
            if r.base:
                if not rel.startswith(r.base + "/"):
                    continue
                sub = rel[len(r.base) + 1 :]
            else:
                sub = rel
            if r.dir_only and not is_dir:
                continue
            if r.regex.fullmatch(sub):
                return None if r.negate else r.why
        return None

    def why(self, rel: str, is_dir: bool) -> str | None:
        """Why `rel` is excluded (a directory above it, or it), or None."""
        parts = rel.split("/")
        for k in range(1, len(parts)):
            why = self._match("/".join(parts[:k]), True)
            if why:
                return why
        return self._match(rel, is_dir)


# -- the directory on disk (--no-git) ---------------------------------------------------------


def is_state_dir(d: Path) -> bool:
    """Whether `d` looks like an evergraph state dir."""
    return any(os.path.lexists(d / f) for f in STATE_FILES) or any(
        (d / s).is_dir() for s in STATE_DIRS
    )


def _special(mode: int) -> str:
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISBLK(mode) or stat.S_ISCHR(mode):
        return "a device file"
    return "not a regular file"


def _from_dir(path: Path, max_file_size: int) -> Bundle:
    root_link = path.absolute().parent
    root = root_link.resolve()
    if is_state_dir(root):
        raise DeployError(
            f"{root_link} is an evergraph state dir (it holds keys or a World): keep the "
            "graph in a directory of its own"
        )
    b = Bundle(entry=path.name, root=root_link)
    limits = _Limits(root_link)
    ignore = Ignore()
    state: dict[Path, bool] = {}

    def inside(real: Path) -> bool:
        return real == root or root in real.parents

    def hard_why(real: Path) -> str | None:
        """Why a real path inside the tree lies in a never-deployed directory."""
        for anc in [*reversed(real.relative_to(root).parents)][1:]:
            d = root / anc
            if d.name == "keys":
                return _KEYS_WHY
            if d not in state:
                state[d] = is_state_dir(d)
            if state[d]:
                return _STATE_WHY
        return None

    def add(rel: str, real: Path, st: os.stat_result) -> None:
        limits.add(rel, st.st_size)
        try:
            data = real.read_bytes()
        except OSError as e:
            raise DeployError(f"{rel}: cannot read: {e.strerror}") from None
        b.files[rel] = Content(data, dp.mode_of(st.st_mode))

    def left(rel: str, why: str, notable: bool = False) -> None:
        b.left_out.append(LeftOut(rel, why, notable))

    def walk(real_dir: Path, rel_dir: str, stack: frozenset[Path]) -> None:
        ign = real_dir / IGNORE_FILE
        if ign.is_file():
            try:
                ignore.add(rel_dir.rstrip("/"), ign.read_text(errors="replace"))
            except OSError as e:
                raise DeployError(f"{rel_dir}{IGNORE_FILE}: cannot read: {e.strerror}") from None
        try:
            entries = sorted(os.scandir(real_dir), key=lambda e: e.name)
        except OSError as e:
            raise DeployError(f"{rel_dir or '.'}: cannot list: {e.strerror}") from None
        for ent in entries:
            name = ent.name
            rel = f"{rel_dir}{name}"
            try:
                rel.encode()
            except UnicodeEncodeError:
                raise DeployError(f"{rel_dir or '.'}: a file name is not UTF-8") from None
            if name == ".git":
                left(rel, "git's own data")
                continue
            real = Path(ent.path)
            if ent.is_symlink():
                target = real.resolve()
                if not inside(target):
                    raise DeployError(
                        f"{rel}: a symlink leaving the deployed directory (to {target})"
                    )
                why = hard_why(target)
                if why is None and target.name == "keys" and target.is_dir():
                    why = _KEYS_WHY
                if why is None and target.is_dir() and is_state_dir(target):
                    why = _STATE_WHY
                if why is not None:
                    left(rel, f"a symlink into {why}", notable=True)
                    continue
                if target != root:  # what is left out stays out, through a link too
                    to = target.relative_to(root).as_posix()
                    why = ignore.why(to, target.is_dir())
                    if why is not None:
                        left(rel, f"a symlink to {to}, which is left out: {why}", notable=True)
                        continue
                real = target
            try:
                st = real.stat()
            except OSError as e:
                left(rel, f"cannot stat: {e.strerror}", notable=True)
                continue
            if stat.S_ISDIR(st.st_mode):
                if name == "keys":
                    left(rel + "/", _KEYS_WHY, notable=True)
                    continue
                if is_state_dir(real):
                    left(rel + "/", _STATE_WHY, notable=True)
                    continue
                why = ignore.why(rel, True)
                if why:
                    left(rel + "/", why)
                    continue
                if real in stack:  # a symlink to an ancestor
                    raise DeployError(f"{rel}: a symlink loop")
                walk(real, rel + "/", stack | {real})
            elif stat.S_ISREG(st.st_mode):
                is_entry = rel == b.entry
                why = None if is_entry else ignore.why(rel, False)
                if why:
                    left(rel, why)
                elif st.st_size > max_file_size:
                    if is_entry:
                        raise DeployError(f"{rel}: {_too_big(st.st_size, max_file_size)}")
                    left(rel, _too_big(st.st_size, max_file_size), notable=True)
                else:
                    add(rel, real, st)
            else:
                left(rel, _special(st.st_mode), notable=True)

    walk(root, "", frozenset({root}))
    if b.entry not in b.files:  # FILE itself left out (a symlink into keys/, ...)
        why = next((lo.why for lo in b.left_out if lo.path == b.entry), "not found")
        raise DeployError(f"{path}: {why}")
    return b


# -- git ------------------------------------------------------------------------------------


def _git(cwd: Path, *args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    try:
        return subprocess.run(
            ["git", *args],
            cwd=cwd,
            input=stdin,
            stdin=None if stdin is not None else subprocess.DEVNULL,
            capture_output=True,
            timeout=60,
            check=False,
        )
    except FileNotFoundError:
        raise DeployError("git is not installed (install it, or deploy with --no-git)") from None
    except subprocess.TimeoutExpired:
        raise DeployError(f"git {args[0]} in {cwd} took over 60 s") from None


def _first_line(text: bytes | str) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[0].strip() if lines else "failed"


def git_head(path: Path) -> str:
    """The HEAD commit of the git repository holding `path`. DeployError when
    `path` is not in a repository or a tracked file under its directory has
    uncommitted (staged or unstaged) changes."""
    d = path.absolute().parent
    if not d.is_dir():
        raise DeployError(f"{d}: no such directory")
    r = _git(d, "rev-parse", "--show-toplevel")
    if r.returncode != 0:
        if b"not a git repository" in r.stderr:
            raise DeployError(
                f"{d} is not in a git repository (deploy with --no-git to skip the git check)"
            )
        raise DeployError(f"git in {d}: {_first_line(r.stderr)}")
    r = _git(d, "rev-parse", "--verify", "--quiet", "HEAD^{commit}")
    if r.returncode != 0:
        raise DeployError(f"the git repository holding {d} has no commit yet")
    head = r.stdout.decode().strip()
    # `-- .`: only files under the deployed directory count
    r = _git(d, "status", "--porcelain=v1", "-z", "--untracked-files=no", "--", ".")
    if r.returncode != 0:
        raise DeployError(f"git status in {d}: {_first_line(r.stderr)}")
    changed = [e for e in r.stdout.decode(errors="replace").split("\0") if len(e) > 3]
    if changed:
        name = changed[0][3:]
        more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
        raise DeployError(
            f"{name} has uncommitted changes{more}: commit them first "
            "(or deploy with --no-git to skip the git check)"
        )
    return head


@dataclass(frozen=True, slots=True)
class _Entry:
    mode: str
    kind: str
    oid: str
    size: int


def _ls_tree(d: Path, commit: str) -> dict[str, _Entry]:
    """Every entry of `commit` under `d` (git limits the listing to the working
    directory), by path relative to `d`."""
    r = _git(d, "ls-tree", "-r", "-z", "-l", commit)
    if r.returncode != 0:
        raise DeployError(f"git ls-tree in {d}: {_first_line(r.stderr)}")
    out: dict[str, _Entry] = {}
    for rec in r.stdout.split(b"\0"):
        if not rec:
            continue
        meta, _, raw = rec.partition(b"\t")
        mode, kind, oid, size = meta.decode().split()
        try:
            rel = raw.decode()
        except UnicodeDecodeError:
            raise DeployError(f"{d}: a tracked file name is not UTF-8") from None
        out[rel] = _Entry(mode, kind, oid, int(size) if size.isdigit() else 0)
    return out


def _cat(d: Path, oids: Iterable[str]) -> dict[str, bytes]:
    """The content of each blob, read from git's objects in one process."""
    want = sorted(set(oids))
    if not want:
        return {}
    r = _git(d, "cat-file", "--batch", stdin=("\n".join(want) + "\n").encode())
    if r.returncode != 0:
        raise DeployError(f"git cat-file in {d}: {_first_line(r.stderr)}")
    out: dict[str, bytes] = {}
    buf, pos = r.stdout, 0
    for oid in want:
        nl = buf.index(b"\n", pos)
        header = buf[pos:nl].decode().split()
        if len(header) != 3 or header[1] != "blob":
            raise DeployError(f"git cat-file in {d}: {oid} is not a blob ({' '.join(header)})")
        size = int(header[2])
        out[oid] = buf[nl + 1 : nl + 1 + size]
        pos = nl + 1 + size + 1
    return out


def _from_git(path: Path, max_file_size: int) -> Bundle:
    d = path.absolute().parent
    commit = git_head(path)
    tree = _ls_tree(d, commit)
    b = Bundle(entry=path.name, root=d, git=commit)
    if b.entry not in tree:
        raise DeployError(
            f"{path}: not tracked at HEAD ({commit[:12]}): commit it first "
            "(or deploy with --no-git)"
        )
    limits = _Limits(d)
    dirs: set[str] = set()
    state_dirs: set[str] = set()
    for p in tree:
        parts = p.split("/")
        for k in range(len(parts) - 1):
            dirs.add("/".join(parts[: k + 1]))
            if parts[k] in STATE_DIRS:
                state_dirs.add("/".join(parts[:k]))
        for f in STATE_FILES:
            if p == f or p.endswith("/" + f):
                state_dirs.add(p[: len(p) - len(f)].rstrip("/"))
    if "" in state_dirs:
        raise DeployError(
            f"{d} is an evergraph state dir (it tracks keys or a World): keep the graph "
            "in a directory of its own"
        )
    ignore = Ignore()
    ignores = sorted(
        (p for p in tree if posixpath.basename(p) == IGNORE_FILE and tree[p].kind == "blob"),
        key=lambda p: p.count("/"),
    )
    texts = _cat(d, (tree[p].oid for p in ignores))
    for p in ignores:
        ignore.add(posixpath.dirname(p), texts[tree[p].oid].decode(errors="replace"))

    reported: set[str] = set()

    def left(rel: str, why: str, notable: bool = False) -> None:
        if rel not in reported:
            reported.add(rel)
            b.left_out.append(LeftOut(rel, why, notable))

    def dir_why(rel: str) -> tuple[str, str, bool] | None:
        """(directory, why, notable) if a directory above `rel` is left out."""
        parts = rel.split("/")
        for k in range(1, len(parts)):
            anc = "/".join(parts[:k])
            if parts[k - 1] == "keys":
                return anc, _KEYS_WHY, True
            if anc in state_dirs:
                return anc, _STATE_WHY, True
            why = ignore.why(anc, True)
            if why:
                return anc, why, False
        return None

    def resolve(rel: str) -> tuple[str, _Entry] | str:
        """The tracked regular file a symlink leads to, or why it cannot be sent."""
        seen = {rel}
        cur = rel
        while tree[cur].mode == "120000":
            target = _cat(d, [tree[cur].oid])[tree[cur].oid].decode(errors="replace")
            nxt = posixpath.normpath(posixpath.join(posixpath.dirname(cur), target))
            if target.startswith("/") or nxt == ".." or nxt.startswith("../"):
                raise DeployError(f"{rel}: a symlink leaving the deployed directory (to {target})")
            if nxt in seen:
                raise DeployError(f"{rel}: a symlink loop")
            seen.add(nxt)
            if nxt not in tree:
                if nxt in dirs:
                    return "a symlink to a directory (git deploys send the files themselves)"
                return f"a symlink to {nxt}, which is not tracked"
            hidden = dir_why(nxt)
            if hidden is not None:
                return f"a symlink into {hidden[0]}/, which is left out: {hidden[1]}"
            why = ignore.why(nxt, False)
            if why is not None:
                return f"a symlink to {nxt}, which is left out: {why}"
            cur = nxt
        return cur, tree[cur]

    picked: dict[str, tuple[str, _Entry]] = {}
    for rel in sorted(tree):
        e = tree[rel]
        above = dir_why(rel)
        if above is not None:
            left(above[0] + "/", above[1], above[2])
            continue
        if e.kind == "commit":
            left(rel + "/", "a git submodule (not part of this repository's tree)", True)
            continue
        is_entry = rel == b.entry
        why = None if is_entry else ignore.why(rel, False)
        if why:
            left(rel, why)
            continue
        got = resolve(rel) if e.mode == "120000" else (rel, e)
        if isinstance(got, str):
            if is_entry:
                raise DeployError(f"{rel}: {got}")
            left(rel, got, notable=True)
            continue
        real, entry = got
        if entry.size > max_file_size:
            if is_entry:
                raise DeployError(f"{rel}: {_too_big(entry.size, max_file_size)}")
            left(rel, _too_big(entry.size, max_file_size), notable=True)
            continue
        limits.add(rel, entry.size)
        picked[rel] = (real, entry)
    blobs = _cat(d, (e.oid for _, e in picked.values()))
    for rel, (_, e) in picked.items():
        mode = 0o755 if e.mode == "100755" else 0o644
        b.files[rel] = Content(blobs[e.oid], mode)
    return b


def descends_from(repo: Path, commit: str) -> Callable[[Deploy | None], Awaitable[None]]:
    """A `check_parent` for `deploys.publish`: the previous deploy's commit, if it
    has one, must be an ancestor of (or equal to) `commit` in the repository at
    `repo` (DeployError otherwise; `--force` skips the check)."""

    async def check(prev: Deploy | None) -> None:
        if prev is None or not prev.git:
            return
        ok = await _is_ancestor(repo, prev.git, commit)
        if ok is False:
            raise DeployError(
                f"commit {commit[:12]} is not a descendant of deploy {prev.n}'s commit "
                f"{prev.git[:12]}; use --force to deploy it anyway"
            )
        if ok is None:
            raise DeployError(
                f"deploy {prev.n}'s commit {prev.git[:12]} is not in the repository at "
                f"{repo}, so {commit[:12]} cannot be checked to descend from it; "
                "use --force to deploy it anyway"
            )

    return check


async def _is_ancestor(repo: Path, old: str, new: str) -> bool | None:
    """Whether commit `old` is an ancestor of (or equal to) `new`; None if `old`
    is not in the repository."""
    import asyncio

    try:
        proc = await asyncio.create_subprocess_exec(
            "git",
            "merge-base",
            "--is-ancestor",
            old,
            new,
            cwd=repo,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
    except FileNotFoundError:
        raise DeployError("git is not installed (install it, or deploy with --no-git)") from None
    _, err = await proc.communicate()
    if proc.returncode == 0:
        return True
    if proc.returncode == 1:
        return False
    if b"not a valid commit" in err or b"bad object" in err or b"Not a valid" in err:
        return None
    raise DeployError(f"git merge-base in {repo}: {_first_line(err)}")
