"""gzip: a file compressed with gzip, made again when its input changes.

mgmt's `gzip`: `path` (default the name) is the compressed file; `input` the
file compressed, or else `content` (text); `level` mgmt's number: -1 the
default, 0 none, 1 (fastest) to 9 (smallest), -2 Huffman coding only.

The output is deterministic: the gzip header carries no file name and time 0,
so the same input at the same level gives the same bytes (with one zlib).
See `_archive.py` for the checks by hash, the atomic write and the watches.
"""

from __future__ import annotations

import hashlib
import os
import zlib
from collections.abc import Iterator
from typing import IO, Annotated

from evergraph.engine.contract import doc, register
from evergraph.errors import ResourceError
from evergraph.resources._archive import Archive, check_path, file_hash
from evergraph.resources._oserror import os_error

_CHUNK = 1 << 20
HUFFMAN_ONLY = -2


@register("gzip")
class Gzip(Archive, kw_only=True, dict=True, forbid_unknown_fields=True):
    """`input` (or `content`) gzip-compressed at `path`, made again whenever it changes."""

    input: Annotated[str | None, doc("absolute path of the file to compress")] = None
    content: Annotated[str, doc("the text to compress when there is no input")] = ""
    level: Annotated[int, doc("-1 default, 0 none, 1 fastest to 9 smallest, -2 Huffman only")] = -1

    def validate(self) -> None:
        check_path(self, "path", self.path or self.name)
        if self.input is not None:
            check_path(self, "input", self.input)
            if self.content:
                raise self.bad("content", "cannot be combined with input: give one of them")
            if os.path.normpath(self.input) == self._out():
                raise self.bad("input", f"{self.input} is the output itself")
        if not HUFFMAN_ONLY <= self.level <= 9:
            raise self.bad("level", f"{self.level} is not between -2 and 9")

    def autoedge_wants(self) -> Iterator[Iterator[str]]:
        yield from super().autoedge_wants()
        if self.input is not None:
            yield iter((f"path:{os.path.normpath(self.input)}",))  # made first (a tar)

    def input_paths(self) -> Iterator[tuple[str, bool]]:
        if self.input is not None:
            yield os.path.normpath(self.input), False

    def input_digest(self) -> str:
        if self.input is None:
            what = "content " + hashlib.sha256(self.content.encode()).hexdigest()
        else:
            path = os.path.normpath(self.input)
            digest = file_hash(path, f"input {path}")
            if digest is None:
                raise ResourceError(f"input {path}: no such file")
            what = "input " + digest
        return hashlib.sha256(f"gzip level {self.level}\n{what}\n".encode()).hexdigest()

    def build(self, out: IO[bytes]) -> None:
        level, strategy = self.level, zlib.Z_DEFAULT_STRATEGY
        if level == HUFFMAN_ONLY:
            level, strategy = zlib.Z_DEFAULT_COMPRESSION, zlib.Z_HUFFMAN_ONLY
        # wbits 31: a gzip header (no name, time 0) and trailer around the stream
        z = zlib.compressobj(level, zlib.DEFLATED, 31, 8, strategy)
        if self.input is None:
            out.write(z.compress(self.content.encode()))
        else:
            path = os.path.normpath(self.input)
            try:
                with open(path, "rb") as f:
                    while chunk := f.read(_CHUNK):
                        out.write(z.compress(chunk))
            except FileNotFoundError:
                raise ResourceError(f"input {path}: no such file") from None
            except OSError as e:
                raise os_error(f"input {path}", e) from None
        out.write(z.flush())
