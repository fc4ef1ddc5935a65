"""The one atomic file write: a reader (or a restart after kill -9) sees the old
file or the new one, never a mix or a half. Every writer of state or managed
files goes through here.

The new content goes to a temporary sibling named `.<name>.<12 hex>.tmp`,
random (unpredictable) and created with O_CREAT|O_EXCL|O_NOFOLLOW in the
target's own directory: a symlink or file planted at that name by another
user is never opened, written or chmod-ed (we retry with another name). Mode
and owner are set on the open file before it gets its real name, so it is
never visible with the wrong ones.

Fsync policy: the temporary file is fsynced before the rename (its content is
on disk before a name points at it), and the directory is fsynced after the
rename (the new name is on disk before we return); a directory we create on
the way is fsynced into its parent too. So after a power cut the target is
the old file or the complete new one, and a returned write is durable.
One exception, the file kind's writes of `content` where nothing was
(`prepare(fresh=True)`, `atomic_write(durable=False)`): a power cut can lose
nothing that was there, only the new file itself (absent, or empty, until the
kernel writes it back: within ~35 s by default, sooner in a running agent,
resources/_commit.py), and the next run makes it again, as it makes any missing
file; what replaces a file is always synced as above. So a first apply of 10k
files waits for no disk, and a repair still never leaves a managed file empty
after a power cut.
Writes may run in several threads at once: those renaming into one directory
share its fsync (a group commit: each returns only after an fsync of the
directory that began after its own rename). A stream of writes (the file kind's
first apply of 10k files) can be split: `prepare` writes each temporary file
without an fsync, and `commit` makes a batch of them durable with the same
ordering, by one syncfs(2) before the renames and one after.

With `dir_fd` the file is named relative to an open directory, so no path
component (a symlink planted by a user in their own home, say) is followed.

A kill -9 between the create and the rename leaves the temporary file:
`sweep_temps` removes those from a state directory at start, and
`sweep_leftovers_of` those next to a managed file.
"""

from __future__ import annotations

import _thread  # (its locks: `threading` would cost `check` ~1 ms of import)
import contextlib
import os
import re
import stat
import time
from collections.abc import Callable, Iterable
from pathlib import Path

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
#: bytes of the target's name kept in a temporary name (NAME_MAX is 255)
_NAME_KEEP = 200
#: fresh names tried when one is taken (by a planted file, or a leftover)
_TRIES = 16
#: what a temporary name of ours looks like; group 1: the (maybe shortened) target name
TEMP_RE = re.compile(r"\A\.(.+)\.[0-9a-f]{12}\.tmp\Z", re.DOTALL)
#: the temporary names earlier versions used next to managed files (pid, object id)
_LEGACY_RE = re.compile(r"\A\.(.+)\.evergraph-[0-9]+(?:-[0-9a-f]+)?\Z", re.DOTALL)


#: random suffixes drawn ahead, 256 at a time: a getrandom(2) per name cost a first
#: apply of 10k files ~50 ms. (list.pop is atomic: two threads never take the same
#: one; a forked child draws its own, see below)
_SUFFIXES: list[str] = []
_DRAW = 256


def _suffix() -> str:
    # os.urandom is the CSPRNG `secrets` wraps; `secrets` would import hmac and
    # hashlib into every command's start-up
    try:
        return _SUFFIXES.pop()
    except IndexError:
        raw = os.urandom(6 * _DRAW).hex()
        _SUFFIXES.extend(raw[k : k + 12] for k in range(0, len(raw), 12))
        return _SUFFIXES.pop()


# a child must not name its files with the suffixes its parent still holds
os.register_at_fork(after_in_child=_SUFFIXES.clear)


def _short(name: str) -> str:
    """`name` cut to _NAME_KEEP bytes (at a character boundary)."""
    raw = name.encode("utf-8", "surrogateescape")
    if len(raw) <= _NAME_KEEP:
        return name
    return raw[:_NAME_KEEP].decode("utf-8", "ignore")


def temp_name(name: str) -> str:
    """A fresh temporary name for a sibling of `name` (`.<name>.<12 hex>.tmp`)."""
    return f".{_short(name)}.{_suffix()}.tmp"


def fsync_dir(path: Path | str) -> None:
    """Make the entries of a directory durable (errors ignored: not every fs can)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, _DIR)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def make_dirs(path: Path | str, mode: int = 0o700) -> None:
    """`mkdir -p` whose every new directory is fsynced into its parent."""
    missing: list[Path] = []
    p = Path(path)
    while not p.is_dir():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=mode)
        except FileExistsError:
            if not d.is_dir():
                raise
            continue
        fsync_dir(d.parent)


def atomic_write(
    path: Path | str,
    data: bytes,
    *,
    mode: int = 0o600,
    owner: tuple[int, int] | None = None,
    exclusive: bool = False,
    dir_mode: int = 0o700,
    dir_fd: int | None = None,
    before_rename: Callable[[int], None] | None = None,
    durable: bool = True,
) -> bool:
    """Write `data` to `path` atomically with `mode` (and `owner`: uid, gid; -1
    keeps ours).

    Without `dir_fd`, missing parents are created (`dir_mode`); with it, `path` is a
    plain name inside that open directory. `exclusive`: never replace an existing
    file (the first writer wins, e.g. two processes creating one key at once);
    returns False if one was there. `before_rename(fd)`: called with the written
    temporary file open, just before it takes the name (file.py notes its inode).
    `durable=False`: no fsync (a record that matters only while the machine stays
    up, like a running child's pid: still atomic across a kill -9 of ours).
    """

    def fill(fd: int) -> None:
        _write_all(fd, data)

    return _write(path, fill, mode, owner, exclusive, dir_mode, dir_fd, before_rename, durable)


def atomic_copy(
    src: Path | str,
    path: Path | str,
    *,
    mode: int = 0o600,
    owner: tuple[int, int] | None = None,
    dir_mode: int = 0o700,
    before_rename: Callable[[int], None] | None = None,
) -> None:
    """`atomic_write` of the content of the regular file `src` (streamed, not read
    whole; a symlink at `src` is refused)."""
    sfd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:

        def fill(fd: int) -> None:
            while chunk := os.read(sfd, 1 << 20):
                _write_all(fd, chunk)

        _write(path, fill, mode, owner, False, dir_mode, None, before_rename, True)
    finally:
        os.close(sfd)


def _write(
    path: Path | str,
    fill: Callable[[int], None],
    mode: int,
    owner: tuple[int, int] | None,
    exclusive: bool,
    dir_mode: int,
    dir_fd: int | None,
    before_rename: Callable[[int], None] | None,
    durable: bool,
) -> bool:
    if dir_fd is None:
        dfd, name = _open_parent(path, dir_mode)
    else:
        dfd, name = dir_fd, str(path)
    try:
        tmp = _temp_file(dfd, name, fill, mode, owner, durable, before_rename)
        placed = False
        try:
            if exclusive:
                try:
                    os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
                except FileExistsError:
                    return False
            else:
                os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
                placed = True
            if durable:
                _sync_dir(dfd)
            return True
        finally:
            if not placed:  # ours until renamed; after, the name may be another's
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp, dir_fd=dfd)
    finally:
        if dir_fd is None:
            os.close(dfd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _open_parent(path: Path | str, dir_mode: int) -> tuple[int, str]:
    """(an open fd of `path`'s directory, created if missing, `path`'s last name).
    Plain strings: pathlib would cost a file kind's stream of 10k writes ~0.2 s."""
    text = os.fspath(path)
    parent, _, name = text.rpartition("/")
    parent = parent or ("/" if text.startswith("/") else ".")
    try:
        return os.open(parent, _DIR), name
    except FileNotFoundError:
        make_dirs(parent, dir_mode)
        return os.open(parent, _DIR), name


def _temp_file(
    dfd: int,
    name: str,
    fill: Callable[[int], None],
    mode: int,
    owner: tuple[int, int] | None,
    fsync: bool,
    before_rename: Callable[[int], None] | None,
) -> str:
    """Create a fresh temporary sibling of `name` in the directory `dfd` (never a
    planted one), give it `owner` and `mode`, `fill` it, fsync it if asked, call
    `before_rename(fd)`; its name. Removed again if any of that fails."""
    for attempt in range(_TRIES):
        tmp = temp_name(name)
        try:
            fd = os.open(tmp, _CREATE, 0o600, dir_fd=dfd)
            break
        except FileExistsError:  # planted, or a leftover: never opened
            if attempt == _TRIES - 1:
                raise
    try:
        try:
            if owner is not None and owner != (os.geteuid(), os.getegid()):
                os.fchown(fd, *owner)
            os.fchmod(fd, mode)  # after chown, which clears set-id bits
            fill(fd)
            if fsync:
                os.fsync(fd)
            if before_rename is not None:
                before_rename(fd)
        finally:
            os.close(fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dfd)
        raise
    return tmp


# -- many writes made durable together ---------------------------------------------------


class Pending:
    """A temporary file `prepare` wrote, not yet durable nor under its name; its
    directory is held open until `commit` (by the Pending itself, `owns_dir`, or by
    the `OpenDirs` it was prepared with). `fresh`: it takes a name where nothing
    was, and is renamed with no sync (the module's fsync policy)."""

    __slots__ = ("dfd", "fresh", "name", "owns_dir", "tmp")

    def __init__(
        self, dfd: int, tmp: str, name: str, owns_dir: bool = True, fresh: bool = False
    ) -> None:
        self.dfd = dfd
        self.tmp = tmp
        self.name = name
        self.owns_dir = owns_dir
        self.fresh = fresh


class OpenDirs:
    """Directories opened once for the many writes `prepare`d into each of them
    together (the file kind's writes of one turn of its loop: a first apply writes
    hundreds into each directory), instead of an open, an fstat and a close per
    write. The caller keeps it until those writes are committed or discarded, then
    `close`s it. Each write still goes into the directory its path named when the
    first of them was prepared, as a lone Pending's goes into the directory its
    path named at its `prepare`."""

    __slots__ = ("fds",)

    def __init__(self) -> None:
        #: parent directory (as the paths spell it) -> its open fd
        self.fds: dict[str, int] = {}

    def open(self, path: str) -> tuple[int, str]:
        """(the open directory of `path`, `path`'s last name); see `_open_parent`."""
        parent, _, name = path.rpartition("/")
        parent = parent or ("/" if path.startswith("/") else ".")  # (as _open_parent)
        dfd = self.fds.get(parent)
        if dfd is None:
            dfd, name = _open_parent(path, 0o755)
            self.fds[parent] = dfd
        return dfd, name

    def close(self) -> None:
        fds = list(self.fds.values())
        self.fds.clear()
        for fd in fds:
            os.close(fd)


def prepare(
    path: str,
    data: bytes,
    *,
    mode: int,
    owner: tuple[int, int] | None = None,
    before_rename: Callable[[int], None] | None = None,
    dirs: OpenDirs | None = None,
    fresh: bool = False,
) -> Pending:
    """The first half of a durable `atomic_write` of `path` (whose directory exists):
    the temporary file, written and closed, with no fsync. `commit` does the rest
    for many at once. `dirs`: take the directory from there (open it there if it is
    not yet), not open it for this write alone. `fresh`: nothing was at `path` when
    the caller looked: `commit` renames it with no sync (the module's fsync policy)."""
    dfd, name = _open_parent(path, 0o755) if dirs is None else dirs.open(path)
    try:

        def fill(fd: int) -> None:
            _write_all(fd, data)

        tmp = _temp_file(dfd, name, fill, mode, owner, False, before_rename)
    except BaseException:
        if dirs is None:
            os.close(dfd)
        raise
    return Pending(dfd, tmp, name, dirs is None, fresh)


def discard(p: Pending) -> None:
    """Give up a `prepare`d write that will not be committed: its temporary file
    removed, its directory closed (if it holds it)."""
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p.tmp, dir_fd=p.dfd)
    finally:
        if p.owns_dir:
            os.close(p.dfd)


#: a batch of at least this many writes is made durable by two syncfs(2) of each
#: filesystem it touches (one for the files' data before the renames, one for the
#: renames), instead of an fsync per file and per directory: on ext4 here, 10k small
#: files took ~0.6-1.6 s that way against ~6 s with an fsync each. A smaller batch
#: (a lone repair) does not flush what other programs have written meanwhile.
SYNCFS_MIN = 8


def by_syncfs(batch: list[Pending]) -> bool:
    """Whether `commit` makes `batch` durable by syncfs(2) (SYNCFS_MIN or more of it
    to sync: its `fresh` writes are not) rather than by an fsync of each file."""
    return len(batch) >= SYNCFS_MIN and sum(not p.fresh for p in batch) >= SYNCFS_MIN


def commit(batch: list[Pending]) -> list[BaseException | None]:
    """Finish what `prepare` began for each of `batch`, as many `atomic_write`s would:
    every file's data is on disk before its rename, and its new name is on disk
    before this returns (so after a power cut each target is its old file or its
    complete new one; a `fresh` one is renamed with no sync, see the module's fsync
    policy). The error of each (None: placed and durable); the directories
    the Pendings hold are closed either way (an `OpenDirs`'s are its owner's to
    close), and a file that was not placed is removed. A batch `by_syncfs` is
    synced by one syncfs(2) of each filesystem before the renames and one after;
    another renames each file right after its own fsync (the first one is in place
    after one fsync, not after the whole batch's), then fsyncs each directory once."""
    try:
        many = by_syncfs(batch)
        errors: list[BaseException | None] = [None] * len(batch)
        by_fs: dict[int, int] = {}  # st_dev -> one open directory on it (many)
        if many:
            by_fs, failed = _sync_filesystems(batch)
            if failed:
                errors = [failed.get(os.fstat(p.dfd).st_dev) for p in batch]
        dirs: dict[tuple[int, int], int] = {}  # those to fsync (not many)
        for i, p in enumerate(batch):
            if not (many or p.fresh) and errors[i] is None:
                try:
                    fd = os.open(p.tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=p.dfd)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                except OSError as e:
                    errors[i] = e
            if errors[i] is None:
                try:
                    os.rename(p.tmp, p.name, src_dir_fd=p.dfd, dst_dir_fd=p.dfd)
                except OSError as e:
                    errors[i] = e
                else:
                    if not (many or p.fresh):
                        st = os.fstat(p.dfd)
                        dirs.setdefault((st.st_dev, st.st_ino), p.dfd)
                    continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p.tmp, dir_fd=p.dfd)
        # the new names durable
        for dfd in by_fs.values():
            with contextlib.suppress(OSError):  # as fsync_dir: not every fs can
                syncfs(dfd)
        for dfd in dirs.values():
            with contextlib.suppress(OSError):
                os.fsync(dfd)
    finally:
        for p in batch:
            if p.owns_dir:
                os.close(p.dfd)
    return errors


def _sync_filesystems(batch: list[Pending]) -> tuple[dict[int, int], dict[int, OSError]]:
    """One syncfs(2) of each filesystem the batch's files to sync are on, so that
    their data is on disk: ({st_dev: an open directory on it}, {st_dev: the error of
    a syncfs that failed})."""
    dev_of: dict[int, int] = {}  # (writes prepared together share a directory fd)
    by_fs: dict[int, int] = {}
    for p in batch:
        if not p.fresh and p.dfd not in dev_of:
            dev = dev_of[p.dfd] = os.fstat(p.dfd).st_dev
            by_fs.setdefault(dev, p.dfd)
    return by_fs, _syncfs_each(by_fs)


def sync_filesystems_of(paths: Iterable[str]) -> None:
    """One syncfs(2) of each filesystem the directories `paths` are on (what was
    written there with no sync put on disk); one that is gone or fails is passed
    over."""
    by_fs: dict[int, int] = {}  # st_dev -> one open directory on it
    try:
        for path in paths:
            try:
                fd = os.open(path, _DIR)
            except OSError:
                continue
            dev = os.fstat(fd).st_dev
            if dev in by_fs:
                os.close(fd)
            else:
                by_fs[dev] = fd
        _syncfs_each(by_fs)
    finally:
        for fd in by_fs.values():
            os.close(fd)


def _syncfs_each(by_fs: dict[int, int]) -> dict[int, OSError]:
    """syncfs(2) through each open directory of {st_dev: fd}: {st_dev: its error}."""
    failed = {}
    for dev, dfd in by_fs.items():
        try:
            syncfs(dfd)
        except OSError as e:
            failed[dev] = e
    return failed


_syncfs: Callable[[int], None] | None = None


def syncfs(fd: int) -> None:
    """syncfs(2): write out everything the filesystem holding `fd` has in memory."""
    global _syncfs
    if _syncfs is None:
        import ctypes  # (loaded with the first batch: `check` writes nothing)

        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.syncfs
        fn.argtypes = [ctypes.c_int]
        fn.restype = ctypes.c_int

        def call(fd: int) -> None:
            if fn(fd) != 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err))

        _syncfs = call
    _syncfs(fd)


class _DirSync:
    """One directory's group commit: `renamed` counts the entries placed in it (a
    ticket each, taken once its rename has returned), `synced` is the last ticket an
    fsync of it covered (one that began after that rename)."""

    __slots__ = ("lock", "renamed", "synced", "users")

    def __init__(self) -> None:
        self.lock = _thread.allocate_lock()  # held across the directory's fsync
        self.renamed = 0
        self.synced = 0
        self.users = 0


#: directories with a write waiting for their fsync, by (st_dev, st_ino)
_dir_syncs: dict[tuple[int, int], _DirSync] = {}
_dir_syncs_lock = _thread.allocate_lock()


def _sync_dir(dfd: int) -> None:
    """fsync the directory `dfd` after an entry was renamed into it. Writes from
    several threads into one directory share fsyncs: one that began after our
    rename returned covers it, so a write that finds the directory being fsynced
    waits for that fsync and then for at most one more, its own or one covering it.
    Errors are ignored as in `fsync_dir`."""
    st = os.fstat(dfd)
    key = (st.st_dev, st.st_ino)
    with _dir_syncs_lock:
        ds = _dir_syncs.get(key)
        if ds is None:
            ds = _dir_syncs[key] = _DirSync()
        ds.renamed += 1
        ticket = ds.renamed
        ds.users += 1
    try:
        with ds.lock:
            if ds.synced >= ticket:
                return  # an fsync that began after our rename has ended
            with _dir_syncs_lock:
                upto = ds.renamed  # every one of these renames has returned
            with contextlib.suppress(OSError):
                os.fsync(dfd)
            ds.synced = upto
    finally:
        with _dir_syncs_lock:
            ds.users -= 1
            if not ds.users:
                del _dir_syncs[key]


# -- leftovers of a kill ----------------------------------------------------------------


def is_temp(name: str) -> bool:
    """A temporary name in a state directory: ours (`.<name>.<hex>.tmp`) or an
    earlier version's (`.<name>.tmp`, e.g. `.refresh.tmp`)."""
    return name.startswith(".") and name.endswith(".tmp") and len(name) > 5


#: seconds a temporary file in a state directory is spared by `sweep_temps`: another
#: process may be writing it (`hosts trust` writing pins.json beside a starting agent)
TEMP_GRACE = 60.0


def sweep_temps(
    root: Path | str,
    prune: Iterable[str] = (),
    temp_dirs_in: Iterable[str] = (),
    grace: float = TEMP_GRACE,
    now: float | None = None,
) -> list[str]:
    """Remove what a kill left in the state directory `root`: every temporary file
    (`is_temp`) in it or below it, except below the relative directories `prune`
    (`*` matches one name: `deploys/*` spares the insides of materialised deploys),
    and the temporary directories directly in the relative directories
    `temp_dirs_in` (an interrupted deploy fetch). Returns the paths removed. Only for
    directories that are entirely ours.

    A temporary file or directory changed less than `grace` seconds before `now`
    (the wall clock by default) is spared: it may be another process's write in
    flight (a CLI command beside a starting agent), not a kill's leftover; the
    temporary names carry no writer's pid to ask the kernel about."""
    skip = [_glob(p) for p in prune]
    dir_homes = set(temp_dirs_in)
    removed: list[str] = []
    top = os.fspath(root)
    when = time.time() if now is None else now

    def young(path: str) -> bool:
        try:
            return when - os.lstat(path).st_mtime < grace
        except FileNotFoundError:
            return True  # gone already: nothing to remove

    for here, dirs, files in os.walk(top):
        rel = os.path.relpath(here, top)
        for d in list(dirs):
            sub = d if rel == "." else f"{rel}/{d}"
            if rel in dir_homes and is_temp(d):
                dirs.remove(d)
                path = os.path.join(here, d)
                if young(path):
                    continue
                import shutil  # (rare: not in every run's start-up, with bz2 and lzma)

                with contextlib.suppress(OSError):
                    shutil.rmtree(path)  # never follows a symlink
                    removed.append(path)
            elif any(p.match(sub) for p in skip):
                dirs.remove(d)
        for f in files:
            path = os.path.join(here, f)
            if is_temp(f) and not young(path):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                    removed.append(path)
    return removed


def _glob(pattern: str) -> re.Pattern[str]:
    return re.compile(re.escape(pattern).replace(r"\*", "[^/]*") + r"\Z")


def leftover_of(name: str) -> str | None:
    """The (maybe shortened) name whose temporary file `name` looks like, or None."""
    m = TEMP_RE.match(name) or _LEGACY_RE.match(name)
    return m.group(1) if m is not None else None


def is_leftover(path: str, of: str) -> bool:
    """`path` is a temporary file of ours for a sibling named `of`, left by a kill:
    named so (`leftover_of`), a regular file, and owned by us."""
    if leftover_of(os.path.basename(path)) not in (of, _short(of)):
        return False
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


#: directory -> (its mtime when scanned, {shortened name: [leftover names]})
_scans: dict[str, tuple[int, dict[str, list[str]]]] = {}


def sweep_leftovers_of(
    path: Path | str, listed: dict[str, dict[str, list[str]]] | None = None
) -> list[str]:
    """Remove the temporary files a killed write of ours left next to `path` (a
    managed file, in a directory that may be shared with other users): regular
    files owned by us, named like our temporary files for `path`. Returns the
    paths removed.

    A directory is listed once while it does not change (its mtime), so a graph
    of many files in one directory lists it once at start, not once per file.
    `listed`: listings the caller keeps and forgets itself (the file kind's, for one
    turn of its event loop), used without a stat of the directory."""
    parent, _, base = os.fspath(path).rpartition("/")
    parent = parent or "/"
    if listed is not None:
        found = _listed(parent, listed)
    else:
        try:
            mtime = os.stat(parent).st_mtime_ns
        except OSError:
            return []
        scan = _scans.get(parent)
        if scan is None or scan[0] != mtime:
            _scans[parent] = scan = (mtime, _leftovers_in(parent))
        found = scan[1]
    if not found:
        return []  # (the common case)
    short = _short(base)
    names = found.pop(short, [])
    if base != short:
        names += found.pop(base, [])  # a legacy name kept it whole
    removed: list[str] = []
    me = os.geteuid()
    for name in names:
        leftover = f"{parent.rstrip('/')}/{name}"
        try:
            st = os.lstat(leftover)
            if stat.S_ISREG(st.st_mode) and st.st_uid == me:
                os.unlink(leftover)
                removed.append(leftover)
        except OSError:
            continue
    return removed


def leftovers_named(path: str, listed: dict[str, dict[str, list[str]]]) -> bool:
    """Whether `path`'s directory holds a name a killed write of ours would have left
    for it (`sweep_leftovers_of` removes such files; this only looks). `listed`: the
    caller's listings, each directory listed once into it."""
    parent, _, base = path.rpartition("/")
    found = _listed(parent or "/", listed)
    return bool(found) and (_short(base) in found or base in found)


def _listed(parent: str, listed: dict[str, dict[str, list[str]]]) -> dict[str, list[str]]:
    found = listed.get(parent)
    if found is None:
        found = listed[parent] = _leftovers_in(parent)
    return found


def _leftovers_in(directory: str) -> dict[str, list[str]]:
    """{the (maybe shortened) name a leftover was for: [leftover names]} in `directory`."""
    found: dict[str, list[str]] = {}
    try:
        with os.scandir(directory) as it:
            for e in it:
                of = leftover_of(e.name) if e.name[0] == "." else None
                if of is not None:
                    found.setdefault(of, []).append(e.name)
    except OSError:
        return {}
    return found


def current_umask() -> int:
    """The process umask (read by setting it and putting it back: call it at import,
    before any thread could create a file in between)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


class ThrottledFile:
    """A small state file rewritten atomically at most once a `period` (seconds):
    `changed()` says its content (`render()`, read at write time) may have moved,
    and a timer of the running loop writes it once the period is over, so a burst
    of changes costs one write, not one each. `flush()` writes now (at a clean
    stop). Replay marks use it: losing the last period's marks to a crash costs
    only their growth in that period, so the write is atomic (a reader sees the
    old marks or the new) but not fsynced unless `durable`: an fsync on the event
    loop every second showed in the export latency's p99 (bench/world.py)."""

    def __init__(
        self,
        path: Path,
        render: Callable[[], bytes],
        period: float = 1.0,
        durable: bool = False,
    ) -> None:
        import asyncio

        self.path = path
        self.render = render
        self.period = period
        self.durable = durable
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None
        self._written: bytes | None = None
        #: writes done (tests)
        self.writes = 0

    def changed(self) -> None:
        if self._timer is None:
            self._timer = self._loop.call_later(self.period, self.flush)

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        data = self.render()
        if data == self._written:
            return
        try:
            atomic_write(self.path, data, mode=0o600, durable=self.durable)
        except OSError as e:
            import logging

            logging.getLogger("evergraph").warning("cannot write %s: %s", self.path, e)
            return
        self._written = data
        self.writes += 1
