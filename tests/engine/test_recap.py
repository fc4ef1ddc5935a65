"""The recap: after the converged line (and at exit, when it has news) the engine
names what changed and what failed, with how long each took — text, or one JSON
object with --log-format json."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from tests.conftest import run_cli, wait_for

#: a log record's first line: its time, then the message
RECORD = re.compile(r"^\d\d:\d\d:\d\d\.\d{3} ")


def graph(tmp_path: Path, extra: str = "") -> Path:
    """file[a] changes, file[same] is already right, exec[bad] fails."""
    same = tmp_path / "same.txt"
    same.write_text("same\n")
    g = tmp_path / "g.yaml"
    g.write_text(
        f"""graph: recap
resources:
  file:
  - name: a
    path: {tmp_path}/a.txt
    content: "one\\n"
  - name: same
    path: {same}
    content: "same\\n"
{extra}  exec:
  - name: bad
    shell: /bin/sh
    cmd: "echo boom >&2; exit 3"
"""
    )
    return g


def recap_lines(stderr: str) -> list[str]:
    """The recap record's lines (its headline and the indented lines after it)."""
    lines = stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"^\S+ recap", line))
    out = [lines[start]]
    for line in lines[start + 1 :]:
        if RECORD.match(line):
            break
        out.append(line)
    return out


def test_the_text_recap_names_what_changed_and_what_failed(tmp_path: Path) -> None:
    r = run_cli("run", graph(tmp_path), "--state-dir", tmp_path / "s", "--converged-exit")
    assert r.returncode == 1, r.stderr
    lines = recap_lines(r.stderr)
    # after the converged line, which keeps its counts
    converged = r.stderr.index("converged with 1 of 3 vertices not clean")
    assert r.stderr.index("recap:") > converged
    assert lines[0].endswith("recap: 1 changed, 1 failed, 1 clean"), lines
    # what changed (the change the resource reported) and how long its check took
    assert re.fullmatch(r"\s+changed file\[a\]: .*content.* \(\d+(\.\d)? ms\)", lines[1]), lines
    assert re.fullmatch(
        r"\s+failed exec\[bad\]: cmd exited with status 3: boom \(\d+(\.\d)? ms\)", lines[2]
    ), lines
    assert len(lines) == 3, lines  # the clean one is counted, not named

    # run again: nothing changes; the converged line is as it was, the recap says so
    r = run_cli("run", graph(tmp_path), "--state-dir", tmp_path / "s", "--converged-exit")
    assert "recap: 0 changed, 1 failed, 2 clean" in r.stderr, r.stderr
    assert "changed file[a]" not in r.stderr


def test_all_clean_keeps_the_converged_line_then_recaps(tmp_path: Path) -> None:
    g = tmp_path / "g.yaml"
    g.write_text(
        f"graph: t\nresources:\n  file:\n  - {{name: a, path: {tmp_path}/a, content: x}}\n"
    )
    run_cli("run", g, "--state-dir", tmp_path / "s", "--converged-exit")
    r = run_cli("run", g, "--state-dir", tmp_path / "s", "--converged-exit")
    assert r.returncode == 0, r.stderr
    assert "converged: 1 vertices clean, 0 changed" in r.stderr
    assert recap_lines(r.stderr)[0].endswith("recap: nothing changed or failed, 1 clean")


def json_records(stderr: str) -> list[dict[str, Any]]:
    """Every line of a --log-format json run's stderr, parsed: each must be JSON."""
    out = []
    for line in stderr.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            raise AssertionError(f"not a JSON line: {line!r}\n{stderr}") from None
    return out


def test_the_json_recap_is_one_object(tmp_path: Path) -> None:
    r = run_cli(
        "run",
        graph(tmp_path),
        "--state-dir",
        tmp_path / "s",
        "--converged-exit",
        "--log-format",
        "json",
    )
    assert r.returncode == 1, r.stderr
    records = json_records(r.stderr)
    recaps = [rec for rec in records if rec.get("event") == "recap"]
    assert len(recaps) == 1, records
    recap = recaps[0]
    assert recap["at"] == "converged"
    assert recap["msg"] == "recap: 1 changed, 1 failed, 1 clean"  # one line: all is in the data
    assert recap["clean"] == 1
    assert recap["vertices"] == 3
    [changed] = recap["changed"]
    assert changed["resource"] == "file[a]"
    assert (changed["kind"], changed["name"]) == ("file", "a")
    assert "content" in [c["field"] for c in changed["changes"]]
    assert 0 < changed["duration"] < 5
    [failed] = recap["failed"]
    assert failed["resource"] == "exec[bad]"
    assert failed["error"] == "cmd exited with status 3: boom"
    assert 0 < failed["duration"] < 5
    # after the converged record
    assert records.index(recap) > next(
        i for i, rec in enumerate(records) if rec["msg"].startswith("converged with")
    )


def test_a_long_recap_shows_twenty_in_text_and_all_in_json(tmp_path: Path) -> None:
    files = "".join(
        f"  - {{name: f{i:02d}, path: {tmp_path}/f{i:02d}, content: x}}\n" for i in range(25)
    )
    g = tmp_path / "g.yaml"
    g.write_text(f"graph: many\nresources:\n  file:\n{files}")
    r = run_cli("run", g, "--state-dir", tmp_path / "s", "--converged-exit")
    lines = recap_lines(r.stderr)
    assert lines[0].endswith("recap: 25 changed, 0 failed, 0 clean"), lines
    named = [line for line in lines if "changed file[" in line]
    assert len(named) == 20, lines
    assert lines[-1].strip() == "… and 5 more changed", lines

    for f in tmp_path.glob("f*"):
        f.unlink()
    r = run_cli("run", g, "--state-dir", tmp_path / "s", "--converged-exit", "--log-format", "json")
    [recap] = [rec for rec in json_records(r.stderr) if rec.get("event") == "recap"]
    assert sorted(c["resource"] for c in recap["changed"]) == [f"file[f{i:02d}]" for i in range(25)]


def test_a_repair_is_recapped_alone(tmp_path: Path, agents: Any) -> None:
    g = graph(tmp_path)
    agent = agents(g, tmp_path / "s")
    agent.wait_converged()
    (tmp_path / "a.txt").write_text("drifted\n")
    agent.wait_converged(2)
    wait_for(lambda: agent.log.read_text().count("recap:") == 2, what="the second recap")
    second = agent.log.read_text().split("recap:")[2]
    assert second.startswith(" 1 changed, 1 failed, 1 clean"), second
    assert "changed file[a]" in second
    assert "failed exec[bad]" in second  # still failed: named again
    assert agent.stop() == 1


def test_a_run_stopped_before_converging_recaps_at_exit(tmp_path: Path) -> None:
    g = graph(
        tmp_path,
        extra=f"""  - name: b
    path: {tmp_path}/b.txt
    content: "b\\n"
""",
    )
    text = g.read_text().replace(
        "  exec:\n",
        f"  exec:\n  - name: slow\n    cmd: sleep 30\n    creates: {tmp_path}/never\n",
    )
    g.write_text(text)
    r = run_cli("run", g, "--state-dir", tmp_path / "s", "--max-runtime", "1.5")
    assert r.returncode == 1, r.stderr
    assert "converged" not in r.stderr
    lines = recap_lines(r.stderr)
    assert lines[0].endswith("recap at exit: 2 changed, 2 failed, 1 clean"), lines
    assert any(re.match(r"\s+failed exec\[slow\]: cancelled ", line) for line in lines), lines
    assert any("changed file[b]" in line for line in lines), lines
