"""Go's `encoding/json`, emulated: what a Go server writes (`dumps`, as
`json.Marshal`) and how it reads a body (`decode`, as `json.NewDecoder(body).Decode`
into a Go type declared here with `Struct`, `Slice`, `Uint`...), byte for byte and
message for message. Pure; knows nothing of Boruta or HTTP (the wire format in
`http/boruta/` declares Boruta's types with it).

Reading follows Go: the first value only (bytes after it are never looked at),
field names matched exactly or else case-insensitively, unknown fields ignored,
a type error noted and decoding carried on (the first one is reported), a syntax
error or an `UnmarshalJSON`/`UnmarshalText` error at once. Go's messages
(`invalid character 'x' looking for beginning of value`, `json: cannot unmarshal
string into Go struct field ReqInfo.ID of type boruta.ReqID`) are kept.

Two limits Go does not have keep a hostile body cheap: `MAX_VALUES` values in
one body and `MAX_DEPTH` levels of nesting (this reader recurses). White space
and string runs are skipped with regular expressions (C speed): a megabyte of
either costs milliseconds.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from evergraph.http.boruta.gotime import TimeError, parse_time

__all__ = [
    "MAX_DEPTH",
    "MAX_VALUES",
    "Bytes",
    "Context",
    "DecodeError",
    "EmptyBody",
    "Map",
    "Node",
    "Pointer",
    "Scanner",
    "Slice",
    "String",
    "Struct",
    "Text",
    "Time",
    "Type",
    "Uint",
    "decode",
    "dumps",
]

# ---------------------------------------------------------------- out: json.Marshal

_HTML_ESCAPES = (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"))
_LINE_SEPARATORS = (("\u2028", "\\u2028"), ("\u2029", "\\u2029"))
_SURROGATE = re.compile("[\ud800-\udfff]")


def dumps(obj: Any) -> bytes:
    """`obj` as Go's `json.Marshal` writes it: no spaces, non-ASCII as UTF-8,
    `<`, `>`, `&`, U+2028 and U+2029 escaped, no trailing newline.

    Dicts keep their order (a Go struct's field order); a Go map's keys are
    sorted, which the callers do themselves. The wire formats here
    hold no floats; a float is written as Python writes it.
    """
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    # These characters can only occur inside strings, so replacing them in the
    # whole text escapes exactly the string contents, as Go does.
    for raw, escaped in _HTML_ESCAPES:
        if raw in text:
            text = text.replace(raw, escaped)
    for raw, escaped in _LINE_SEPARATORS:
        if raw in text:
            text = text.replace(raw, escaped)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: Go writes U+FFFD for it
        return _SURROGATE.sub("\ufffd", text).encode("utf-8")


# ---------------------------------------------------------------- in: Go's scanner


class EmptyBody(Exception):
    """The body holds no JSON value (Go's io.EOF)."""


class DecodeError(Exception):
    """Decoding stops here: Go returns this error at once (a syntax error, or
    an UnmarshalJSON / UnmarshalText method's error)."""


_SPACE = frozenset(b" \t\r\n")
#: a run of JSON white space; the next byte a string literal must look at (its end,
#: an escape, a control character): runs between are skipped at C speed, so a
#: body of a megabyte of spaces or of one long string costs milliseconds
_SPACES = re.compile(rb"[ \t\r\n]*")
_STRING_STOP = re.compile(rb'["\\\x00-\x1f]')
#: values (of any kind) one body may hold: Boruta's hold a few dozen; past this a
#: body is refused (a 400) before its reading costs the agent's loop anything
MAX_VALUES = 10_000
_NAMED_ESCAPES = {7: "\\a", 8: "\\b", 9: "\\t", 10: "\\n", 11: "\\v", 12: "\\f", 13: "\\r"}
_STRING_ESCAPES = {
    ord('"'): '"',
    ord("\\"): "\\",
    ord("/"): "/",
    ord("b"): "\b",
    ord("f"): "\f",
    ord("n"): "\n",
    ord("r"): "\r",
    ord("t"): "\t",
}
_HEX = frozenset(b"0123456789abcdefABCDEF")


def _quote_char(c: int) -> str:
    """A byte as Go's JSON scanner names it in an error: `'x'`, `'\\n'`, `'\\x01'`."""
    if c == ord("'"):
        return "'\\''"
    if c == ord('"'):
        return "'\"'"
    if c in _NAMED_ESCAPES:
        return f"'{_NAMED_ESCAPES[c]}'"
    if c == ord("\\"):
        return "'\\\\'"
    if c < 0x20 or c == 0x7F:
        return f"'\\x{c:02x}'"
    if 0x80 <= c <= 0xA0 or c == 0xAD:
        return f"'\\u{c:04x}'"
    return f"'{chr(c)}'"


class Node:
    """One JSON value as Go's decoder sees it: its kind (`string`, `number`,
    `bool`, `null`, `array`, `object`), its value, and its raw text (a time is
    parsed from the raw text between the quotes, as Go does)."""

    __slots__ = ("kind", "raw", "value")

    def __init__(self, kind: str, value: Any, raw: str = "") -> None:
        self.kind = kind
        self.value = value
        self.raw = raw


#: arrays and objects nested deeper than this are refused (`exceeded max depth`)
MAX_DEPTH = 64


class Scanner:
    """Reads the first JSON value of a body as Go's `json.Decoder` does: bytes
    after it are never looked at; a value cut short is `unexpected EOF`; a bad
    byte is Go's `invalid character ...` message."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0
        #: arrays and objects open around the value being read
        self.depth = 0
        #: values read so far (see MAX_VALUES)
        self.values = 0

    def fail(self, context: str) -> DecodeError:
        if self.pos >= len(self.data):
            return DecodeError("unexpected EOF")
        return DecodeError(f"invalid character {_quote_char(self.data[self.pos])} {context}")

    def skip_space(self) -> None:
        m = _SPACES.match(self.data, self.pos)
        assert m is not None  # (`*`: it always matches)
        self.pos = m.end()

    def peek(self) -> int:
        return self.data[self.pos] if self.pos < len(self.data) else -1

    def top(self) -> Node:
        self.skip_space()
        if self.pos >= len(self.data):
            raise EmptyBody
        return self.value()

    def value(self) -> Node:
        self.skip_space()
        self.values += 1
        if self.values > MAX_VALUES:
            raise DecodeError(f"more than {MAX_VALUES} values in one body")
        c = self.peek()
        if c == ord("{") or c == ord("["):
            # Go stops at 10,000 levels; this reader recurses, so it stops sooner
            # (a Boruta body is three levels deep): a 400, never a RecursionError
            if self.depth >= MAX_DEPTH:
                raise DecodeError("exceeded max depth")
            self.depth += 1
            try:
                return self.object() if c == ord("{") else self.array()
            finally:
                self.depth -= 1
        if c == ord('"'):
            text, raw = self.string()
            return Node("string", text, raw)
        if c == ord("-") or ord("0") <= c <= ord("9"):
            return self.number()
        for word, node in ((b"true", Node("bool", True)), (b"false", Node("bool", False))):
            if c == word[0]:
                self.literal(word)
                return node
        if c == ord("n"):
            self.literal(b"null")
            return Node("null", None)
        raise self.fail("looking for beginning of value")

    def literal(self, word: bytes) -> None:
        for expected in word:
            if self.peek() != expected:
                raise self.fail(f"in literal {word.decode()} (expecting {_quote_char(expected)})")
            self.pos += 1

    def number(self) -> Node:
        data, start = self.data, self.pos

        def digits() -> None:
            while self.pos < len(data) and 0x30 <= data[self.pos] <= 0x39:
                self.pos += 1

        if self.peek() == ord("-"):
            self.pos += 1
            if not 0x30 <= self.peek() <= 0x39:
                raise self.fail("in numeric literal")
        if self.peek() == ord("0"):
            self.pos += 1
        else:
            digits()
        if self.peek() == ord("."):
            self.pos += 1
            if not 0x30 <= self.peek() <= 0x39:
                raise self.fail("after decimal point in numeric literal")
            digits()
        if self.peek() in (ord("e"), ord("E")):
            self.pos += 1
            if self.peek() in (ord("+"), ord("-")):
                self.pos += 1
            if not 0x30 <= self.peek() <= 0x39:
                raise self.fail("in exponent of numeric literal")
            digits()
        text = data[start : self.pos].decode("ascii")
        return Node("number", text, text)

    def string(self) -> tuple[str, str]:
        data = self.data
        self.pos += 1  # the opening quote
        start = self.pos
        parts: list[str] = []
        run = start
        while True:
            stop = _STRING_STOP.search(data, self.pos)
            if stop is None:
                self.pos = len(data)
                raise DecodeError("unexpected EOF")
            self.pos = stop.start()
            c = data[self.pos]
            if c == ord('"'):
                parts.append(data[run : self.pos].decode("utf-8", "replace"))
                raw = data[start : self.pos].decode("utf-8", "replace")
                self.pos += 1
                return "".join(parts), raw
            if c < 0x20:
                raise self.fail("in string literal")
            parts.append(data[run : self.pos].decode("utf-8", "replace"))
            self.pos += 1
            c = self.peek()
            if c in _STRING_ESCAPES:
                parts.append(_STRING_ESCAPES[c])
                self.pos += 1
            elif c == ord("u"):
                self.pos += 1
                parts.append(chr(self.hex4()))
            else:
                raise self.fail("in string escape code")
            run = self.pos

    def hex4(self) -> int:
        """The character of a `\\uXXXX` escape (the `\\u` read): a surrogate pair
        makes one character; a lone half is U+FFFD, as in Go."""
        code = self.raw_hex4()
        if 0xD800 <= code < 0xDC00:
            save = self.pos
            if self.data[self.pos : self.pos + 2] == b"\\u":
                self.pos += 2
                low = self.raw_hex4()
                if 0xDC00 <= low < 0xE000:
                    return 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)
                self.pos = save  # not a pair: the next escape stands alone
            return 0xFFFD
        return 0xFFFD if 0xDC00 <= code < 0xE000 else code

    def raw_hex4(self) -> int:
        start = self.pos
        for _ in range(4):
            if self.peek() not in _HEX:
                raise self.fail("in \\u hexadecimal character escape")
            self.pos += 1
        return int(self.data[start : self.pos], 16)

    def object(self) -> Node:
        self.pos += 1
        members: list[tuple[str, Node]] = []
        self.skip_space()
        if self.peek() == ord("}"):
            self.pos += 1
            return Node("object", members)
        while True:
            self.skip_space()
            if self.peek() != ord('"'):
                raise self.fail("looking for beginning of object key string")
            key, _ = self.string()
            self.skip_space()
            if self.peek() != ord(":"):
                raise self.fail("after object key")
            self.pos += 1
            members.append((key, self.value()))
            self.skip_space()
            if self.peek() == ord(","):
                self.pos += 1
                continue
            if self.peek() == ord("}"):
                self.pos += 1
                return Node("object", members)
            raise self.fail("after object key:value pair")

    def array(self) -> Node:
        self.pos += 1
        items: list[Node] = []
        self.skip_space()
        if self.peek() == ord("]"):
            self.pos += 1
            return Node("array", items)
        while True:
            items.append(self.value())
            self.skip_space()
            if self.peek() == ord(","):
                self.pos += 1
                continue
            if self.peek() == ord("]"):
                self.pos += 1
                return Node("array", items)
            raise self.fail("after array element")


# ---------------------------------------------------------------- in: Go's types


class Context:
    """Where the decoder is (for Go's type error text) and the first type error
    (Go keeps decoding after one, and reports the first)."""

    def __init__(self) -> None:
        self.struct = ""
        self.fields: list[str] = []
        self.saved: str | None = None

    def type_error(self, value: str, go_type: str) -> None:
        if self.saved is not None:
            return
        if self.struct or self.fields:
            where = f"Go struct field {self.struct}.{'.'.join(self.fields)}"
        else:
            where = "Go value"
        self.saved = f"json: cannot unmarshal {value} into {where} of type {go_type}"

    def type_error_text(self, message: str) -> None:
        """Another error Go saves and goes on (it reports the first)."""
        if self.saved is None:
            self.saved = message


class Type:
    """A Go type a JSON value is decoded into."""

    go_type = ""

    def zero(self) -> Any:
        return None

    def decode(self, node: Node, ctx: Context) -> Any:
        raise NotImplementedError


class String(Type):
    def __init__(self, go_type: str) -> None:
        self.go_type = go_type

    def zero(self) -> Any:
        return ""

    def decode(self, node: Node, ctx: Context) -> Any:
        if node.kind == "string":
            return node.value
        if node.kind != "null":
            ctx.type_error(node.kind, self.go_type)
        return ""


class Uint(Type):
    def __init__(self, go_type: str, bits: int) -> None:
        self.go_type = go_type
        self.limit = 1 << bits

    def zero(self) -> Any:
        return 0

    def decode(self, node: Node, ctx: Context) -> Any:
        if node.kind == "number":
            text = node.value
            if text.isdigit() and int(text) < self.limit:
                return int(text)
            ctx.type_error(f"number {text}", self.go_type)
        elif node.kind != "null":
            ctx.type_error(node.kind, self.go_type)
        return 0


class Time(Type):
    go_type = "time.Time"

    def zero(self) -> Any:
        return 0.0

    def decode(self, node: Node, ctx: Context) -> Any:
        if node.kind == "null":
            return 0.0
        if node.kind != "string":
            raise DecodeError("Time.UnmarshalJSON: input is not a JSON string")
        try:
            return parse_time(node.raw)
        except TimeError as exc:
            raise DecodeError(str(exc)) from None


class Text(Type):
    """A type with Go's `UnmarshalText`: `parse` reads the string (it raises
    `DecodeError` with the method's message), e.g. Boruta's SortOrder."""

    def __init__(self, go_type: str, parse: Callable[[str], bool]) -> None:
        self.go_type = go_type
        self.parse = parse

    def zero(self) -> Any:
        return False

    def decode(self, node: Node, ctx: Context) -> Any:
        if node.kind == "string":
            return self.parse(node.value)
        if node.kind != "null":
            ctx.type_error(node.kind, self.go_type)
        return False


class Slice(Type):
    def __init__(self, go_type: str, elem: Type) -> None:
        self.go_type = go_type
        self.elem = elem

    def decode(self, node: Node, ctx: Context) -> Any:
        if node.kind == "array":
            return [self.elem.decode(item, ctx) for item in node.value]
        if node.kind != "null":
            ctx.type_error(node.kind, self.go_type)
        return None


class Bytes(Slice):
    """A slice of a uint8 type (Boruta's `[]Priority`): Go also reads (and its
    clients write) it as a base64 string."""

    _ALPHABET = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")

    def decode(self, node: Node, ctx: Context) -> Any:
        if node.kind != "string":
            return super().decode(node, ctx)
        text = node.value.replace("\r", "").replace("\n", "")
        try:
            return list(base64.b64decode(text, validate=True))
        except binascii.Error:
            # Go's CorruptInputError names the first byte it could not take
            bad = next(
                (i for i, c in enumerate(text) if c not in self._ALPHABET and c != "="),
                len(text) - len(text) % 4,
            )
            ctx.type_error_text(f"illegal base64 data at input byte {bad}")
            return None


class Map(Type):
    def __init__(self, go_type: str, elem: Type) -> None:
        self.go_type = go_type
        self.elem = elem

    def decode(self, node: Node, ctx: Context) -> Any:
        if node.kind == "object":
            return {key: self.elem.decode(value, ctx) for key, value in node.value}
        if node.kind != "null":
            ctx.type_error(node.kind, self.go_type)
        return None


class Struct(Type):
    """A Go struct: fields matched by name, exactly or else case-insensitively;
    unknown names ignored; a repeated name: the last one counts."""

    def __init__(self, go_type: str, fields: Sequence[tuple[str, Type]]) -> None:
        self.go_type = go_type
        self.name = go_type.rpartition(".")[2]
        self.fields = dict(fields)
        self.folded = {name.lower(): name for name in self.fields}

    def zero(self) -> Any:
        return {name: kind.zero() for name, kind in self.fields.items()}

    def decode(self, node: Node, ctx: Context) -> Any:
        result = self.zero()
        if node.kind == "null":
            return result
        if node.kind != "object":
            ctx.type_error(node.kind, self.go_type)
            return result
        outer = ctx.struct
        for key, value in node.value:
            name = key if key in self.fields else self.folded.get(key.lower())
            if name is None:
                continue
            ctx.fields.append(name)
            ctx.struct = self.name
            result[name] = self.fields[name].decode(value, ctx)
            ctx.fields.pop()
            ctx.struct = outer
        return result


class Pointer(Type):
    """A pointer to a struct: null is nil (None), anything else the struct."""

    def __init__(self, target: Struct) -> None:
        self.go_type = target.go_type
        self.target = target

    def decode(self, node: Node, ctx: Context) -> Any:
        return None if node.kind == "null" else self.target.decode(node, ctx)


def decode(body: bytes, kind: Type) -> Any:
    """`body` decoded into `kind` as Go's `json.NewDecoder(body).Decode` does.

    Raises `EmptyBody` when the body holds no value (Go's `io.EOF`: the caller
    decides what that means), else `DecodeError` with Go's message: a syntax
    error, an `UnmarshalJSON`/`UnmarshalText` error, or the first type error."""
    node = Scanner(body).top()
    ctx = Context()
    value = kind.decode(node, ctx)
    if ctx.saved is not None:
        raise DecodeError(ctx.saved)
    return value
