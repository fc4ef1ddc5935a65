"""tar: an archive of files and directories, rebuilt when an input changes.

mgmt's `tar`: `path` (default the name) is the archive, `inputs` the absolute
paths put in it: a file by its base name; a directory with a trailing slash
by its contents (`/srv/site/` gives `index.html`, ...), without one under its
own name (`/srv/site` gives `site/`, `site/index.html`, ...), as rsync
decides. `format` is mgmt's number: 0 (the default: ustar, with pax headers
where a name needs them), 2 ustar, 4 pax, 8 gnu.

The archive is deterministic: entries in name order, every time 0, owner
and group 0 without names; modes, symbolic links and contents are kept.
Inside a directory, symbolic links are stored as links (an input named
directly is followed); devices, sockets and FIFOs are left out. See
`_archive.py` for the checks by hash, the atomic write and the watches.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tarfile
from collections.abc import Iterator
from typing import IO, Annotated

from evergraph.engine.contract import doc, register
from evergraph.errors import ResourceError
from evergraph.resources._archive import Archive, check_path, file_hash
from evergraph.resources._oserror import os_error

#: mgmt's format numbers (Go's archive/tar) -> Python's
FORMATS = {
    0: tarfile.PAX_FORMAT,
    2: tarfile.USTAR_FORMAT,
    4: tarfile.PAX_FORMAT,
    8: tarfile.GNU_FORMAT,
}

_Entry = tuple[str, str, os.stat_result]  # name in the archive, path, its status


@register("tar")
class Tar(Archive, kw_only=True, dict=True, forbid_unknown_fields=True):
    """An archive of `inputs` at `path`, built again whenever an input changes."""

    inputs: Annotated[
        list[str],
        doc("absolute paths: a file; a directory/ for its contents; a directory for itself"),
    ] = []
    format: Annotated[
        int, doc("0 (default, ustar + pax headers as needed), 2 ustar, 4 pax, 8 gnu")
    ] = 0

    def validate(self) -> None:
        check_path(self, "path", self.path or self.name)
        if not self.inputs:
            raise self.bad("inputs", "is empty: give the paths to archive")
        out = self._out()
        for i, inp in enumerate(self.inputs):
            if not inp.startswith("/") or "\0" in inp:
                raise self.bad(f"inputs.{i}", f"{inp!r} is not an absolute path")
            norm = os.path.normpath(inp)
            if out == norm or out.startswith(norm.rstrip("/") + "/"):
                raise self.bad(f"inputs.{i}", f"{inp} holds the archive {out} itself")
        if self.format not in FORMATS:
            raise self.bad("format", f"{self.format} is not 0, 2 (ustar), 4 (pax) or 8 (gnu)")

    def autoedge_wants(self) -> Iterator[Iterator[str]]:
        yield from super().autoedge_wants()
        for inp in self.inputs:
            norm = os.path.normpath(inp)
            yield iter((f"path:{norm}",))  # a file made by another resource first
            yield iter((f"dir:{norm.rstrip('/')}/",))

    def input_paths(self) -> Iterator[tuple[str, bool]]:
        for inp in self.inputs:
            yield os.path.normpath(inp), True

    # -- the entries -------------------------------------------------------------
    def _entries(self) -> list[_Entry]:
        out: list[_Entry] = []
        seen: dict[str, str] = {}
        for inp in self.inputs:
            path = os.path.normpath(inp)
            try:
                st = os.stat(path)  # an input named directly is followed
            except FileNotFoundError:
                raise ResourceError(f"inputs: {path}: no such file or directory") from None
            except OSError as e:
                raise os_error(f"inputs: {path}", e) from None
            if stat.S_ISDIR(st.st_mode):
                prefix = "" if inp.endswith("/") else os.path.basename(path) + "/"
                found = [(prefix, path, st)] if prefix else []
                found += _walk(path, prefix)
            elif stat.S_ISREG(st.st_mode):
                found = [(os.path.basename(path), path, st)]
            else:
                raise ResourceError(f"inputs: {path}: not a file or directory")
            for name, p, est in found:
                if name in seen:
                    raise ResourceError(
                        f"inputs: {seen[name]} and {p} are both {name!r} in the archive"
                    )
                seen[name] = p
                out.append((name, p, est))
        return out

    def input_digest(self) -> str:
        h = hashlib.sha256(f"tar format {self.format}\n".encode())
        for name, path, st in self._entries():
            mode = stat.S_IMODE(st.st_mode)
            if stat.S_ISREG(st.st_mode):
                what = file_hash(path, f"inputs: {path}") or "gone"
            elif stat.S_ISLNK(st.st_mode):
                what = "link " + _readlink(path)
            else:
                what = "dir"
            h.update(f"{name}\0{mode:o}\0{what}\n".encode(errors="surrogateescape"))
        return h.hexdigest()

    def build(self, out: IO[bytes]) -> None:
        try:
            with tarfile.open(
                fileobj=out,
                mode="w",
                format=FORMATS[self.format],
                encoding="utf-8",
                errors="surrogateescape",
            ) as tar:
                for name, path, st in self._entries():
                    _add(tar, name, path, st)
        except (OSError, tarfile.TarError, ValueError) as e:
            raise ResourceError(f"{self._out()}: cannot archive: {e}") from None


def _walk(top: str, prefix: str) -> Iterator[_Entry]:
    """Below `top`, in name order, without following links: (name, path, lstat)."""
    try:
        names = sorted(os.listdir(top))
    except OSError as e:
        raise os_error(f"inputs: {top}", e) from None
    for n in names:
        p = f"{top.rstrip('/')}/{n}"
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            continue  # gone while listed: the watch tells us
        if stat.S_ISDIR(st.st_mode):
            yield f"{prefix}{n}/", p, st
            yield from _walk(p, f"{prefix}{n}/")
        elif stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
            yield f"{prefix}{n}", p, st


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError as e:
        raise os_error(f"inputs: {path}", e) from None


def _add(tar: tarfile.TarFile, name: str, path: str, st: os.stat_result) -> None:
    info = tarfile.TarInfo(name.rstrip("/"))  # a directory gets its / back from tarfile
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISDIR(st.st_mode):
        info.type = tarfile.DIRTYPE
        tar.addfile(info)
    elif stat.S_ISLNK(st.st_mode):
        info.type = tarfile.SYMTYPE
        info.linkname = _readlink(path)
        tar.addfile(info)
    else:
        with open(path, "rb") as f:
            info.size = os.fstat(f.fileno()).st_size  # what is read now, not at the walk
            tar.addfile(info, f)
