"""What a noop run runs of the user's commands, exactly (issue 23 item 5): `--noop`
runs exec's guards (ifcmd, nifcmd) and watchcmd, as mgmt and Salt do, never cmd or
donecmd; `--noop-no-commands` runs none and reports what the guards would have
decided as "unknown" (exit 3, as for a change)."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import run_cli


def _graph(tmp: Path) -> Path:
    g = tmp / "g.yaml"
    g.write_text(
        "graph: guards\nresources:\n  exec:\n"
        "  - name: guarded\n    shell: /bin/sh\n"
        f"    ifcmd: touch {tmp}/ifcmd-ran\n"
        f"    cmd: touch {tmp}/cmd-ran\n"
        f"    donecmd: touch {tmp}/donecmd-ran\n"
        f"    watchcmd: touch {tmp}/watchcmd-ran; sleep 600\n"
        "  - name: plain\n    shell: /bin/sh\n"
        f"    cmd: touch {tmp}/plain-ran\n"
        "  - name: created\n    shell: /bin/sh\n"
        f"    creates: {tmp}\n"
        f"    cmd: touch {tmp}/created-ran\n"
    )
    return g


def test_noop_runs_the_guards_and_watchcmd_never_cmd_or_donecmd(tmp_path: Path) -> None:
    r = run_cli(
        "run", _graph(tmp_path), "--state-dir", tmp_path / "s", "--noop", "--converged-exit"
    )
    assert r.returncode == 3, r.stderr
    assert (tmp_path / "ifcmd-ran").exists()
    for never in ("cmd-ran", "donecmd-ran", "plain-ran", "created-ran"):
        assert not (tmp_path / never).exists(), never
    assert "would change exec[guarded]" in r.stderr


def test_noop_no_commands_runs_none_and_reports_unknown(tmp_path: Path) -> None:
    r = run_cli(
        "run",
        _graph(tmp_path),
        "--state-dir",
        tmp_path / "s",
        "--noop-no-commands",
        "--converged-exit",
    )
    assert r.returncode == 3, r.stderr
    for never in ("ifcmd-ran", "watchcmd-ran", "cmd-ran", "donecmd-ran", "plain-ran"):
        assert not (tmp_path / never).exists(), never
    assert "1 unknown" in r.stderr
    assert "unknown exec[guarded]: ifcmd not run (--noop-no-commands)" in r.stderr
    # no guard that needs a command: reported as a plain noop would
    assert "would change exec[plain]" in r.stderr
    assert "exec[created]" not in r.stderr.split("recap")[-1]


def test_noop_no_commands_with_nothing_unknown_exits_0(tmp_path: Path) -> None:
    g = tmp_path / "g.yaml"
    g.write_text(f"resources:\n  exec:\n  - name: c\n    creates: {tmp_path}\n    cmd: 'false'\n")
    r = run_cli("run", g, "--state-dir", tmp_path / "s", "--noop-no-commands", "--converged-exit")
    assert r.returncode == 0, r.stderr
