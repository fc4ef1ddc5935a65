"""`file` with `recurse` and `mode` on a tree where an unprivileged user owns a
subtree and races symlink swaps in it (renameat2 RENAME_EXCHANGE of a file of
its own and a symlink to a root file, of a directory of its own and a symlink to
a root directory) while the agent keeps re-applying the mode: the agent never
changes anything through a symlink, so the root file and directory keep their
modes. The agent and the racer are real processes; the user is made and removed
by the test."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Agent
from tests.kit.localuser import SYSTEM_PYTHON, as_user, local_user, needs_root, shared_dir
from tests.kit.machine import MACHINE_WIDE

pytestmark = MACHINE_WIDE

#: how long the racer races (seconds) at most
RACE_FOR = 10.0

RACER = r"""
import ctypes, os, sys, time

here, stop = sys.argv[1], sys.argv[2]
libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD, RENAME_EXCHANGE = -100, 2
os.chdir(here)
fd = os.open("f", os.O_RDONLY)
dfd = os.open("d", os.O_RDONLY | os.O_DIRECTORY)
rounds = swaps = 0
deadline = time.monotonic() + float(sys.argv[3])
while time.monotonic() < deadline and not os.path.exists(stop):
    for a, b in ((b"f", b"lf"), (b"d", b"ld")):
        if libc.renameat2(AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE) == 0:
            swaps += 1
    # the agent set our file's (or directory's) mode: count a round, undo it
    for h, want in ((fd, 0o600), (dfd, 0o700)):
        if os.fstat(h).st_mode & 0o777 != want:
            rounds += 1
            os.fchmod(h, want)
print(rounds, swaps)
"""


@pytest.mark.slow
@needs_root()
def test_recursive_mode_never_follows_a_swapped_symlink(tmp_path: Path, agents: Any) -> None:
    with shared_dir() as d, local_user() as user:
        secret = d / "secret"
        secret.write_text("root only\n")
        secret.chmod(0o600)
        secret_dir = d / "secret-dir"
        secret_dir.mkdir(mode=0o700)
        tree = d / "tree"
        mine = tree / "u"
        mine.mkdir(parents=True)
        (tree / "plain").write_text("x\n")
        (mine / "f").write_text("the user's\n")
        (mine / "d").mkdir()
        (mine / "lf").symlink_to(secret)
        (mine / "ld").symlink_to(secret_dir)
        (mine / "f").chmod(0o600)
        (mine / "d").chmod(0o700)
        subprocess.run(["chown", "-hR", f"{user}:{user}", str(mine)], check=True)
        racer = d / "racer.py"
        racer.write_text(RACER)
        g = tmp_path / "g.yaml"
        g.write_text(
            f"graph: race\nresources:\n  file:\n  - name: {tree}/\n    recurse: true\n"
            '    mode: "0755"\n'
        )
        a: Agent = agents(g, tmp_path / "s")
        a.wait_converged()
        assert (mine / "f").stat().st_mode & 0o777 == 0o755  # applied to the user's files
        assert secret.stat().st_mode & 0o777 == 0o600
        stop = d / "stop"
        proc = subprocess.Popen(
            as_user(user, SYSTEM_PYTHON, racer, mine, stop, str(RACE_FOR)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        modes = {secret: 0o600, secret_dir: 0o700}
        try:
            deadline = time.monotonic() + RACE_FOR
            changed: dict[Path, int] = {}
            while time.monotonic() < deadline and proc.poll() is None and not changed:
                changed = {p: p.stat().st_mode & 0o777 for p in modes}
                changed = {p: m for p, m in changed.items() if m != modes[p]}
                time.sleep(0.01)  # polling the modes, not a synchronisation
        finally:
            stop.touch()
            got, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        rounds, swaps = map(int, got.split())
        assert changed == {}, f"a root entry's mode changed through a symlink after {rounds} rounds"
        assert {p: p.stat().st_mode & 0o777 for p in modes} == modes
        assert swaps > 100
        assert rounds >= 10, f"the agent re-applied the mode only {rounds} times"
        assert a.stop() == 0
