"""Per-vertex state that must survive a crash, under `vertices/<kind>/<name-encoded>/`.

- `intent.json`: written before a vertex with notify children applies: the
  children to refresh if it changes something. Removed once their `refresh`
  flags are written (or the apply found nothing to change, or failed). A kill at
  any instruction between the start of the apply and the flags leaves it, and the
  next start owes those refreshes: a change is never lost, even if the agent dies
  after changing the machine but before recording it.
- `refresh`: a notify edge's refresh is owed. Written *before* the child is
  scheduled and removed right after the child's apply served it, so a kill -9 in
  between leaves the file and the next start refreshes the child again. The
  guarantee: every change of a parent is followed by at least one refresh of each
  notify child; a refresh is served twice only if the agent dies between the
  child's apply starting and its flag being removed right after it returned.
- `reversal.json`: how to undo a `meta.reverse` resource (its kind and the
  parameters that restore the state found before its first apply). Applied
  when the resource leaves the graph, also across a restart. Of a vertex that
  received a secret, it is sealed with the host key (`{"sealed": TOKEN}`):
  the state it restores may be the previous secret.

Every write is temp file + fsync + rename. The layout of the state dir
(`vertex_dir`, `encode_name`, `vertex_name`) lives here too; the store knows
vertices by kind and name only, not the Vertex class.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import msgspec

from evergraph._util.atomic import atomic_write

log = logging.getLogger("evergraph.engine")

REFRESH = "refresh"
INTENT = "intent.json"
REVERSAL = "reversal.json"
#: the key of a reversal record kept sealed (it may hold a secret)
SEALED = "sealed"


#: longest encoded name used as it is (NAME_MAX is 255 bytes)
_ENCODED_MAX = 200
#: in a directory named by a hash (a name too long for a path component): the name
NAME_FILE = "@name"


def encode_name(name: str) -> str:
    """A resource name as one safe path component, unique per name and reversible
    (`vertex_name`): percent-encoded (`/`, NUL, `%`, non-ASCII...), `.` and `..`
    encoded whole; when too long, a prefix, `%~` and the name's SHA-256 (the whole
    name is then kept in the directory's `@name` file)."""
    enc = quote(name, safe="", errors="surrogatepass")
    if enc in (".", ".."):
        return enc.replace(".", "%2E")
    if len(enc) > _ENCODED_MAX:
        head = enc[:100]
        cut = head.rfind("%", len(head) - 2)  # not in the middle of a %XX
        if cut >= 0:
            head = head[:cut]
        digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()
        return f"{head}%~{digest}"  # quote never makes "%~": no plain name looks so
    return enc


def vertex_dir(state_dir: Path, kind: str, name: str) -> Path:
    """`vertices/<kind>/<encode_name(name)>` under the state dir. For a hashed
    (long) name the directory is made here with its `@name` file, so the
    start-up scan can read the name back."""
    enc = encode_name(name)
    d = state_dir / "vertices" / kind / enc
    if "%~" in enc and not (d / NAME_FILE).exists():
        with contextlib.suppress(OSError):  # a write into `d` reports it
            atomic_write(d / NAME_FILE, name.encode("utf-8", "surrogatepass"))
    return d


def vertex_name(path: str | os.PathLike[str]) -> str:
    """The resource name of a vertex directory (`vertex_dir`'s inverse)."""
    base = os.path.basename(os.fspath(path))
    if "%~" in base:
        try:
            with open(os.path.join(path, NAME_FILE), "rb") as f:
                return f.read().decode("utf-8", "surrogatepass")
        except (OSError, UnicodeDecodeError):
            return base
    return unquote(base, errors="surrogatepass")


class Owed(msgspec.Struct):
    """What an earlier run left to do. (A Struct: a dataclass's generated methods
    are compiled at import.)"""

    refresh: set[str] = msgspec.field(default_factory=set)
    #: identity -> reversal record ({"kind": ..., "params": {...}})
    reversals: dict[str, dict[str, Any]] = msgspec.field(default_factory=dict)


class VertexStore:
    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.root = state_dir / "vertices"

    def _path(self, kind: str, name: str, what: str) -> Path:
        return vertex_dir(self.state_dir, kind, name) / what

    # -- refresh ----------------------------------------------------------------
    def owe_refresh(self, kind: str, name: str) -> None:
        try:
            atomic_write(self._path(kind, name, REFRESH), b"1\n")
        except OSError as e:
            log.error("%s[%s]: cannot persist its pending refresh: %s", kind, name, e)

    def refresh_served(self, kind: str, name: str) -> None:
        self._remove(self._path(kind, name, REFRESH), f"{kind}[{name}]")

    def owe_refresh_to(self, ident: str) -> None:
        """Persist an owed refresh by identity (`kind[name]`, maybe not in the graph)."""
        kind, _, rest = ident.partition("[")
        self.owe_refresh(kind, rest[:-1])

    # -- write-ahead intent -------------------------------------------------------
    def intend(self, kind: str, name: str, children: Iterable[str]) -> bool:
        """Before `kind[name]` applies: whom (`children`, idents) to refresh if it
        changes something."""
        import json  # (with the first record: a run may have none)

        data = json.dumps(sorted(children)).encode()
        try:
            atomic_write(self._path(kind, name, INTENT), data)
        except OSError as e:
            log.error(
                "%s[%s]: cannot persist its intent (refreshes may be lost): %s", kind, name, e
            )
            return False
        return True

    def intent_done(self, kind: str, name: str) -> None:
        self._remove(self._path(kind, name, INTENT), f"{kind}[{name}]")

    # -- reversal ---------------------------------------------------------------
    def has_reversal(self, kind: str, name: str) -> bool:
        return self._path(kind, name, REVERSAL).exists()

    def save_reversal(
        self,
        kind: str,
        name: str,
        record: dict[str, Any],
        seal: Callable[[bytes], bytes] | None = None,
    ) -> None:
        """`seal` (the host key's): the record may hold a secret, kept only sealed as
        `{"sealed": TOKEN}`; `open_reversal` gives it back."""
        import json  # (with the first record: a run may have none)

        data = json.dumps(record).encode()
        if seal is not None:
            data = json.dumps({SEALED: seal(data).decode("ascii")}).encode()
        atomic_write(self._path(kind, name, REVERSAL), data)

    @staticmethod
    def is_sealed(record: dict[str, Any]) -> bool:
        return SEALED in record

    @staticmethod
    def open_reversal(record: dict[str, Any], unseal: Callable[[bytes], bytes]) -> dict[str, Any]:
        """The record a sealed one holds (ValueError if it is not one)."""
        import json  # (with the first record: a run may have none)

        token = record.get(SEALED)
        if not isinstance(token, str):
            raise ValueError("not a sealed reversal record")
        opened = json.loads(unseal(token.encode("ascii")))
        if not isinstance(opened, dict) or "params" not in opened:
            raise ValueError("not a reversal record")
        return opened

    def load_reversal(self, kind: str, name: str) -> dict[str, Any] | None:
        import json  # (with the first record: a run may have none)

        try:
            with open(self._path(kind, name, REVERSAL), "rb") as f:
                record = json.loads(f.read())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.error("%s[%s]: unreadable reversal: %s", kind, name, e)
            return None
        return record if isinstance(record, dict) else None

    def reversal_done(self, kind: str, name: str) -> None:
        self._remove(self._path(kind, name, REVERSAL), f"{kind}[{name}]")

    # -- start-up ---------------------------------------------------------------
    def load(self) -> Owed:
        owed = Owed()
        try:
            kinds = list(os.scandir(self.root))
        except FileNotFoundError:
            return owed
        for kind in kinds:
            if not kind.is_dir():
                continue
            for name in os.scandir(kind.path):
                ident = f"{kind.name}[{vertex_name(name.path)}]"
                if os.path.exists(os.path.join(name.path, REFRESH)):
                    owed.refresh.add(ident)
                self._recover_intent(ident, os.path.join(name.path, INTENT), owed)
                rev = os.path.join(name.path, REVERSAL)
                if os.path.exists(rev):
                    import json  # (with the first record: a run may have none)

                    try:
                        with open(rev, "rb") as f:
                            record = json.loads(f.read())
                        if not isinstance(record, dict) or (
                            "params" not in record and SEALED not in record
                        ):
                            raise ValueError("not a reversal record")
                        owed.reversals[ident] = record
                    except (OSError, ValueError) as e:
                        log.error("%s: unreadable reversal %s: %s", ident, rev, e)
        if owed.refresh:
            log.info(
                "%d refreshes owed from the last run: %s",
                len(owed.refresh),
                ", ".join(sorted(owed.refresh)),
            )
        return owed

    def _recover_intent(self, ident: str, path: str, owed: Owed) -> None:
        """An apply that was under way when the last run died: it may have changed
        something, so its children are owed their refresh (flags written first)."""
        try:
            with open(path, "rb") as f:
                import json  # (with the first record: a run may have none)

                children = json.loads(f.read())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as e:
            log.error("%s: unreadable intent %s: %s", ident, path, e)
            children = None
        if isinstance(children, list):
            for child in children:
                if isinstance(child, str) and "[" in child and child.endswith("]"):
                    self.owe_refresh_to(child)
                    owed.refresh.add(child)
            if children:
                log.info(
                    "%s was applying when the last run ended: refreshing %s",
                    ident,
                    ", ".join(map(str, children)),
                )
        self._remove(Path(path), ident)

    def _remove(self, path: Path, ident: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.error("%s: cannot remove %s: %s", ident, path, e)
