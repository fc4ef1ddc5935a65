"""augeas: values set in a configuration file through an Augeas lens (mgmt's augeas).

`file` is read and parsed with `lens` (e.g. `Sshd.lns`, `Hosts.lns`: one of
the lenses libaugeas ships) into a tree; each of `sets` names a node of that
tree by a path relative to the file (`X11Forwarding`, `*[canonical='db']/ipaddr`)
and the value it must hold. Nodes that differ are set, the tree is written back
through the lens (which keeps comments, order and layout of everything else),
and the file replaced atomically with its mode and owner. A file that is not
there is made (0644) from an empty text.

Augeas itself never touches the file system here: the text goes in and out
through `aug_text_store`/`aug_text_retrieve` (no lens autoloading, no file
loading), so only the one lens is compiled (once per resource; the first parse
of a big lens takes tens of milliseconds, in a worker thread) and the write is
evergraph's own atomic one.

A text the lens does not parse, or a tree it cannot write back (a value the
lens refuses, a new node where the lens does not allow it), is a failure naming
the file, the lens and augeas' reason; the file is left as it was.

The watch is inotify on the file (the shared hub). Reversal sets the values
found before the first change again (a node that was not there is left).
Needs libaugeas (Debian:
`libaugeas0`, with its lenses in `augeas-lenses`) and python-augeas.
"""

from __future__ import annotations

import asyncio
import os
import stat
from typing import TYPE_CHECKING, Annotated, Any

import msgspec

from evergraph._util.atomic import atomic_write
from evergraph.engine.contract import Handle, Resource, doc, parent_dir_keys, register
from evergraph.errors import ResourceError
from evergraph.resources._oserror import os_error

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

#: where the text and its tree live inside the Augeas handle
_TEXT, _TREE, _OUT = "/text", "/tree", "/out"


class Set(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One value to hold: the node at `path` (relative to the file's tree) is `value`."""

    path: Annotated[str, doc("the node, relative to the file (`X11Forwarding`)")]
    value: Annotated[str | bool, doc("its value (true/false are written as such)")]

    def text(self) -> str:
        if isinstance(self.value, bool):
            return "true" if self.value else "false"
        return self.value


def _augeas() -> Any:
    try:
        import augeas
    except (ImportError, OSError) as e:  # the binding, or libaugeas.so.0 missing
        raise ResourceError(
            f"libaugeas is not usable ({e}): install libaugeas0 and augeas-lenses"
        ) from None
    return augeas


@register("augeas")
class Augeas(Resource, kw_only=True, dict=True, forbid_unknown_fields=True):
    """Values in a configuration file, set through an Augeas lens, the rest kept."""

    file: Annotated[str, doc("the file (absolute path); default the name")] = ""
    lens: Annotated[str, doc("the lens that parses it, `Module.lns` (`Sshd.lns`)")] = ""
    sets: Annotated[list[Set], doc("the values to hold: `{path, value}` each")] = []

    def _path(self) -> str:
        return os.path.normpath(self.file or self.name)

    def validate(self) -> None:
        path = self.file or self.name
        field = "file" if self.file else "name"
        if not path.startswith("/"):
            raise self.bad(field, f"{path!r} is not an absolute path (the file to edit)")
        if "\0" in path:
            raise self.bad(field, "contains a NUL byte")
        module, dot, lens = self.lens.partition(".")
        if not self.lens:
            raise self.bad("lens", "needs the lens that parses the file (`Sshd.lns`, ...)")
        if not dot or not module or not lens.endswith("lns") or not module[0].isupper():
            raise self.bad("lens", f"{self.lens!r} is not a lens name like `Sshd.lns`")
        if not self.sets:
            raise self.bad("sets", "nothing to set: give [{path, value}, ...]")
        seen: dict[str, str] = {}
        for s in self.sets:
            path_ = s.path.strip("/")
            if not path_ or "\0" in s.path or "\n" in s.path:
                raise self.bad("sets", f"{s.path!r} is not a node path")
            if path_ in seen and seen[path_] != s.text():
                raise self.bad("sets", f"{s.path!r} is given two values")
            seen[path_] = s.text()

    def claims(self) -> list[str]:
        return [f"augeas:{self._path()}:{s.path.strip('/')}" for s in self.sets]

    def claims_part(self) -> list[str]:
        return [f"content:{self._path()}"]

    def autoedge_wants(self) -> Iterator[Iterator[str]]:
        path = self._path()
        yield parent_dir_keys(path)
        yield iter((f"path:{path}",))  # a file resource that makes it (mode, owner)
        yield iter((f"pkgfile:{path}",))  # the package that installs it

    def reversal(self) -> Augeas | None:
        """The values found now, for the nodes that have one (a node that is not
        there now is not removed by the reversal: sets cannot say so)."""
        try:
            with open(self._path(), encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError):
            return None
        lib = _augeas()
        aug = lib.Augeas(flags=lib.Augeas.NO_LOAD | lib.Augeas.NO_MODL_AUTOLOAD)
        try:
            aug.set(_TEXT, text)
            aug.text_store(self.lens, _TEXT, _TREE)
            old = []
            for s in self.sets:
                value = aug.get(f"{_TREE}/{s.path.strip('/')}")
                if value is not None:
                    old.append(Set(path=s.path, value=value))
        except (ValueError, OSError):
            return None
        finally:
            aug.close()
        if not old:
            return None
        return Augeas(name=self.name, file=self.file, lens=self.lens, sets=old)

    async def init(self, handle: Handle) -> None:
        await super().init(handle)
        self._aug: Any = None

    async def cleanup(self) -> None:
        aug = getattr(self, "_aug", None)
        if aug is not None:
            self._aug = None
            aug.close()

    def subscribe(self) -> Callable[[], None]:
        return self.handle.watcher.subscribe(self._path(), lambda _mask: self.handle.event())

    async def check_apply(self, apply: bool) -> bool:
        path = self._path()
        try:
            with open(path, "rb") as f:
                st: os.stat_result | None = os.fstat(f.fileno())
                data = f.read()
        except FileNotFoundError:
            st, data = None, b""
        except OSError as e:
            raise os_error(f"cannot read {path}", e) from None
        try:
            text = data.decode()
        except UnicodeDecodeError:
            raise ResourceError(f"{path} is not UTF-8 text: augeas cannot edit it") from None
        # the lens compiles on first use (tens of ms): off the event loop
        changes, new = await asyncio.to_thread(self._edit, text)
        if not changes:
            return True
        for node, old, value in changes:
            self.handle.changed(node, old, value)
        if apply:
            mode = stat.S_IMODE(st.st_mode) if st is not None else 0o644
            owner = (st.st_uid, st.st_gid) if st is not None else None
            try:
                atomic_write(path, new.encode(), mode=mode, owner=owner, dir_mode=0o755)
            except OSError as e:
                raise os_error(f"cannot write {path}", e) from None
            nodes = ", ".join(node for node, _, _ in changes)
            self.handle.logger.info("%s: %s set in %s", self.ident, nodes, path)
        return False

    def _edit(self, text: str) -> tuple[list[tuple[str, str | None, str]], str]:
        """Parse `text`, set what differs; the changes (node, old, new) and the new text."""
        lib = _augeas()
        if self._aug is None:
            flags = lib.Augeas.NO_LOAD | lib.Augeas.NO_MODL_AUTOLOAD
            self._aug = lib.Augeas(flags=flags)
        aug = self._aug
        aug.remove(_TREE)
        aug.remove(_OUT)
        aug.set(_TEXT, text)
        try:
            aug.text_store(self.lens, _TEXT, _TREE)
        except (ValueError, OSError):
            raise ResourceError(self._why("cannot parse", _TREE)) from None
        changes: list[tuple[str, str | None, str]] = []
        for s in self.sets:
            node = f"{_TREE}/{s.path.strip('/')}"
            value = s.text()
            try:
                old = aug.get(node)
            except (ValueError, OSError):
                raise ResourceError(
                    f"{s.path!r} in {self._path()}: not one node (a path matching several?)"
                ) from None
            if old == value:
                continue
            changes.append((s.path, old, value))
            try:
                aug.set(node, value)
            except (ValueError, OSError):
                raise ResourceError(
                    f"{s.path!r} in {self._path()}: augeas cannot set it (matches several?)"
                ) from None
        if not changes:
            return [], text
        try:
            aug.text_retrieve(self.lens, _TEXT, _TREE, _OUT)
        except (ValueError, OSError):
            raise ResourceError(self._why("cannot write back", _TREE)) from None
        return changes, str(aug.get(_OUT) or "")

    def _why(self, what: str, node: str) -> str:
        """augeas' reason for the last failure on `node`, one line."""
        aug = self._aug
        where = f"/augeas/text{node}/error"
        kind = aug.get(where) if aug.match(where) else None
        if kind is None:
            return (
                f"{what} {self._path()} with {self.lens}: the lens did not load"
                " (no such lens? see /usr/share/augeas/lenses)"
            )
        message = (aug.get(f"{where}/message") or kind).splitlines()[0]
        line = aug.get(f"{where}/line") if aug.match(f"{where}/line") else None
        at = f" at line {line}" if line else ""
        return f"{what} {self._path()} with {self.lens}{at}: {message}"
