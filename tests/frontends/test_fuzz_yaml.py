"""Fuzzing `evergraph check` with mutated YAML graphs: whatever the file holds, the
answer is exit 0 (valid) or exit 2 with one line naming the file, never a traceback,
never a hang.

Seeded (the same cases on every run), a few hundred graphs derived from
examples/*.yaml and the hand-written graphs below, each run in process through the
CLI's own `check` command (click's CliRunner: no interpreter start-up per case).
A failure prints the case's number and its bytes, to reproduce it by hand."""

from __future__ import annotations

import random
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

import pytest
from click.testing import CliRunner

from evergraph.cli.main import cli
from tests.conftest import REPO

SEED = 20260613
CASES = 400
#: a case that takes longer hangs (the whole test is well under 20 s)
CASE_LIMIT = 5.0

HAND_WRITTEN = [
    # send/recv, notify, meta, every edge key
    """graph: wired
resources:
  exec:
  - name: build
    cmd: "echo built"
    shell: /bin/sh
    env: {LANG: C}
    args: []
    meta: {retry: 3, delay: 500, sema: [build, "io:2"], poll: 5, timeout: 30}
  file:
  - name: out
    path: /tmp/evergraph-fuzz/out
    mode: "0640"
    state: exists
  kv:
  - name: greeting
    key: cfg/greeting
    value: hello
    mapped: true
  password:
  - name: db
    length: 32
edges:
- name: e1
  from: {kind: exec, name: build, send: stdout}
  to: {kind: file, name: out, recv: content}
- {from: {kind: kv, name: greeting}, to: {kind: exec, name: build}, notify: true}
- {from: {kind: password, name: db}, to: {kind: file, name: out}}
""",
    # collect, exports, mgmt compatibility keys
    """graph: cluster
comment: collects what web hosts export
resources:
  file:
  - name: "@@motd"
    path: /tmp/evergraph-fuzz/motd
    content: "hi\\n"
    meta: {export: ["*"], reverse: true}
  timer:
  - name: tick
    interval: 2.5
  print:
  - name: say
    msg: tock
collect:
- {kind: file, filter: {host: web1, name: motd}}
- {kind: file, filter: {path: /tmp/x}}
edges:
- {from: {kind: timer, name: tick}, to: {kind: print, name: say}, notify: true}
""",
    # users, groups, keys, services, packages: many typed fields
    """graph: accounts
resources:
  group:
  - name: ops
    gid: 2001
  user:
  - name: deploy
    uid: 2001
    gid: 2001
    groups: [ops]
    home: /home/deploy
    shell: /bin/bash
    state: exists
  ssh_authorized_key:
  - name: deploy-key
    user: deploy
    type: ssh-ed25519
    key: AAAAC3NzaC1lZDI1NTE5AAAAIAABAgMEBQYHCAkKCwwNDg8QERITFBUWFxgZGhscHR4f
    comment: deploy@laptop
  svc:
  - name: nginx
    state: running
    startup: enabled
  pkg:
  - name: nginx
    state: installed
  noop:
  - name: done
    meta: {hidden: false, realize: true, limit: .inf, burst: 1}
edges:
- {from: {kind: group, name: ops}, to: {kind: user, name: deploy}}
- {from: {kind: pkg, name: nginx}, to: {kind: svc, name: nginx}, notify: true}
""",
    # flow style, anchors and aliases, block scalars
    """graph: flow
resources: {noop: [{name: a, comment: &c "shared"}, {name: b, comment: *c}],
  file: [{name: f, path: /tmp/evergraph-fuzz/f, content: >-
      folded
      text}]}
edges: [{from: {kind: noop, name: a}, to: {kind: noop, name: b}}]
""",
]

#: what a value may be replaced by: every YAML type, and odd numbers
VALUES = [
    "42", "-1", "0", "1.5", "-0.0", '"text"', "''", "plain words", "null", "~", "true",
    "no", "[a, 1]", "[]", "{k: v}", "{}", "0o777", "0x1F", "0644", "2001-01-01",
    "!!binary aGVsbG8=", "&x [1]", "*undefined", "|\n  block", ">\n  folded", "'", '"',
    "[", "{", "- a", "? k", "@@name", "%TAG", "`cmd`", "!!python/object:os.system",
    "1e400", "-1e400", "1e-400", "99999999999999999999999999999", "-9223372036854775809",
    ".nan", ".inf", "-.inf", ".NaN", "0b101", "1_000", "12:30:00",
]  # fmt: skip
#: what may be inserted anywhere: unicode and control characters, and invalid UTF-8
INSERTS = [
    "\x00", "\x07", "\x1b[31m", "\t", "\r", "\r\n", "\u202e", "\ufeff", "\u2028", "\u0085",
    "é", "\U0001d54f", "中文", "\U0001f600", " ", ":", ": ", "-", "#", "&a ", "*a", "!", "%", "@",
    "\\", '"', "'", "{", "}", "[", "]", ",", "|", ">",
]  # fmt: skip
RAW_INSERTS = [b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xef\xbb\xbf", b"\x80\x80"]


def _lines(text: str) -> list[str]:
    return text.split("\n")


def delete_line(rng: random.Random, text: str) -> str:
    lines = _lines(text)
    del lines[rng.randrange(len(lines))]
    return "\n".join(lines)


def duplicate_line(rng: random.Random, text: str) -> str:
    lines = _lines(text)
    i = rng.randrange(len(lines))
    lines.insert(i, lines[i])
    return "\n".join(lines)


def swap_lines(rng: random.Random, text: str) -> str:
    lines = _lines(text)
    i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
    lines[i], lines[j] = lines[j], lines[i]
    return "\n".join(lines)


def reindent(rng: random.Random, text: str) -> str:
    lines = _lines(text)
    i = rng.randrange(len(lines))
    stripped = lines[i].lstrip(" ")
    indent = max(0, len(lines[i]) - len(stripped) + rng.choice([-4, -2, -1, 1, 2, 4, 40]))
    lines[i] = " " * indent + stripped
    return "\n".join(lines)


def flip_type(rng: random.Random, text: str) -> str:
    """A `key: value` gets a value of another type (string, int, list, map, ...)."""
    lines = _lines(text)
    spots = [i for i, line in enumerate(lines) if ":" in line and not line.lstrip().startswith("#")]
    if not spots:
        return text
    i = rng.choice(spots)
    head = lines[i].split(":", 1)[0]
    lines[i] = f"{head}: {rng.choice(VALUES)}"
    return "\n".join(lines)


def flip_block(rng: random.Random, text: str) -> str:
    """A key's whole block (a list of resources, a mapping) becomes a scalar, or the
    reverse: a scalar becomes a block list or mapping."""
    lines = _lines(text)
    spots = [i for i, line in enumerate(lines) if line.rstrip().endswith(":")]
    if spots and rng.random() < 0.5:
        i = rng.choice(spots)
        lines[i] += " " + rng.choice(VALUES)  # the block below now hangs off a scalar
    else:
        i = rng.randrange(len(lines))
        indent = " " * (len(lines[i]) - len(lines[i].lstrip(" ")) + 2)
        head = lines[i].split(":", 1)[0]
        block = rng.choice([[f"{indent}- x", f"{indent}- 2"], [f"{indent}k: v", f"{indent}n: 1"]])
        lines[i : i + 1] = [f"{head}:", *block]
    return "\n".join(lines)


def insert_char(rng: random.Random, text: str) -> str:
    i = rng.randrange(len(text) + 1)
    return text[:i] + rng.choice(INSERTS) + text[i:]


def truncate(rng: random.Random, text: str) -> str:
    return text[: rng.randrange(len(text) + 1)]


def huge_number(rng: random.Random, text: str) -> str:
    """A value (a number's, mostly) becomes a huge number: past 64 bits, past a float,
    past the 4300 digits Python prints."""
    lines = _lines(text)
    numbers = [i for i, line in enumerate(lines) if re.search(r":\s*-?\d", line)]
    spots = (
        numbers if numbers and rng.random() < 0.7 else [i for i, x in enumerate(lines) if ":" in x]
    )
    if not spots:
        return text
    i = rng.choice(spots)
    head = lines[i].split(":", 1)[0]
    digits = rng.choice([25, 400, 4400, 6000])
    big = rng.choice(["9" * digits, "-" + "9" * digits, "1e" + "9" * rng.randrange(3, 30)])
    lines[i] = f"{head}: {big}"
    return "\n".join(lines)


def deep_nesting(rng: random.Random, text: str) -> str:
    """A value nested tens to hundreds of levels deep (flow or block)."""
    lines = _lines(text)
    spots = [i for i, line in enumerate(lines) if ":" in line]
    if not spots:
        return text
    i = rng.choice(spots)
    head = lines[i].split(":", 1)[0]
    depth = rng.choice([30, 120, 300, 700])
    if rng.random() < 0.5:
        open_, close = rng.choice([("[", "]"), ("{a: ", "}")])
        lines[i] = f"{head}: {open_ * depth}1{close * depth}"
    else:
        indent = " " * (len(head) - len(head.lstrip(" ")) + 2)
        block = []
        for _ in range(depth):
            block.append(indent + "k:")
            indent += "  "
        block[-1] += " 1"
        lines[i : i + 1] = [f"{head}:", *block]
    return "\n".join(lines)


def complex_key(rng: random.Random, text: str) -> str:
    """A mapping or a list where a key belongs (`{a: 1}: x`, `? [a, b]`)."""
    lines = _lines(text)
    spots = [i for i, line in enumerate(lines) if ":" in line]
    if not spots:
        return text
    i = rng.choice(spots)
    head, _, value = lines[i].partition(":")
    indent = head[: len(head) - len(head.lstrip(" -"))]
    key = rng.choice(["{a: 1}", "[a, b]", "{k: [1]}"])
    lines[i] = f"{indent}{key}:{value}" if rng.random() < 0.5 else f"{indent}? {key}"
    return "\n".join(lines)


MUTATIONS: list[Callable[[random.Random, str], str]] = [
    delete_line,
    duplicate_line,
    swap_lines,
    reindent,
    flip_type,
    flip_type,
    flip_block,
    insert_char,
    truncate,
    huge_number,
    deep_nesting,
    complex_key,
]


def originals() -> list[str]:
    examples = sorted((REPO / "examples").glob("*.yaml"))
    assert examples, "examples/*.yaml"
    return [p.read_text() for p in examples] + HAND_WRITTEN


def cases() -> Iterator[tuple[int, bytes]]:
    rng = random.Random(SEED)
    base = originals()
    for n in range(CASES):
        text = rng.choice(base)
        for _ in range(rng.choice([1, 1, 2, 3])):
            text = rng.choice(MUTATIONS)(rng, text)
        data = text.encode("utf-8", "surrogatepass")
        if rng.random() < 0.03:  # bytes that are not UTF-8
            i = rng.randrange(len(data) + 1)
            data = data[:i] + rng.choice(RAW_INSERTS) + data[i:]
        yield n, data


class CaseTimeout(Exception):
    pass


def _alarm(signum: int, frame: FrameType | None) -> None:
    raise CaseTimeout(f"a case ran for more than {CASE_LIMIT} s")


def test_the_originals_are_valid(tmp_path: Path) -> None:
    """The unmutated graphs pass (so the mutations are what is refused)."""
    runner = CliRunner()
    for i, text in enumerate(originals()):
        f = tmp_path / f"orig{i}.yaml"
        f.write_text(text)
        r = runner.invoke(cli, ["check", str(f)])
        assert r.exit_code == 0, (i, r.output)


def test_mutated_yaml_is_exit_0_or_a_one_line_exit_2(tmp_path: Path) -> None:
    runner = CliRunner()
    outcomes = {0: 0, 2: 0}
    slowest = (0.0, -1)
    started = time.monotonic()
    previous = signal.signal(signal.SIGALRM, _alarm)
    try:
        for n, data in cases():
            f = tmp_path / f"case{n}.yaml"
            f.write_bytes(data)
            what = f"case {n} (seed {SEED}): {data[:2000]!r}"
            t0 = time.monotonic()
            signal.setitimer(signal.ITIMER_REAL, CASE_LIMIT)
            try:
                r = runner.invoke(cli, ["check", str(f)])
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            took = time.monotonic() - t0
            slowest = max(slowest, (took, n))
            if r.exception is not None and not isinstance(r.exception, SystemExit):
                raise AssertionError(f"{what}\nraised {r.exception!r}") from r.exception
            assert r.exit_code in (0, 2), f"{what}\nexit {r.exit_code}: {r.output}"
            assert "Traceback" not in r.output, f"{what}\n{r.output}"
            if r.exit_code == 2:
                lines = r.stderr.strip().splitlines()
                assert len(lines) == 1, f"{what}\n{r.stderr}"
                assert lines[0].startswith(f"evergraph: {f}"), f"{what}\n{r.stderr}"
            outcomes[r.exit_code] += 1
            f.unlink()
    finally:
        signal.signal(signal.SIGALRM, previous)
    elapsed = time.monotonic() - started
    print(
        f"{CASES} mutated graphs in {elapsed:.2f} s: {outcomes[0]} valid, {outcomes[2]} "
        f"refused; slowest case {slowest[1]} ({slowest[0]:.3f} s)"
    )
    # both outcomes occur: the mutations neither break everything nor nothing
    assert outcomes[0] >= CASES // 20, outcomes
    assert outcomes[2] >= CASES // 2, outcomes
    assert elapsed < 20, f"{elapsed:.1f} s"


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m.__name__)
def test_each_mutation_changes_the_text(mutation: Callable[[random.Random, str], str]) -> None:
    rng = random.Random(SEED)
    text = originals()[0]
    assert any(mutation(rng, text) != text for _ in range(20))
