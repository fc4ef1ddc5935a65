"""Reading a YAML graph file's text, and saying where in it: the fast parser
(`yaml_rs`) for the data, and, only on the error path, PyYAML's node tree for
`file:line:col` (`Locator`)."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from typing import Any

from evergraph.engine.build import PathPart
from evergraph.errors import InputError
from evergraph.frontends import _yaml_rs as yaml_rs

_LINE_COL = re.compile(r"line (\d+), column (\d+)")
#: how an integer may be written in YAML (decimal, octal, hex, with `_`)
_INT_SOURCE = re.compile(r"[-+]?[0-9][0-9a-fA-FoObBxX_]*")


class Locator:
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


def long_number_at(text: str, filename: str) -> str:
    """`file:line:col` of the first number too long to print."""
    m = re.search(rf"\d{{{sys.get_int_max_str_digits() + 1},}}", text)
    if m is None:
        return filename
    line = text.count("\n", 0, m.start()) + 1
    col = m.start() - (text.rfind("\n", 0, m.start()) + 1) + 1
    return f"{filename}:{line}:{col}"


def load_text(text: str, filename: str, loc: Locator) -> Any:
    """The whole text, parsed (InputError naming `file:line:col`)."""
    try:
        return yaml_rs.loads(text)
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
