"""exec: run a command — guarded, so it runs only when needed.

Without a guard (`creates`, `ifcmd`, `nifcmd`, `refresh_only`) the command
runs on every check: at start-up, and on every event of its `watchcmd` or
`watchfiles`. With `shell` the command goes to that shell (`sh -c CMD`);
with `args`, `cmd` is the program and `args` its arguments, exactly as given;
otherwise `cmd` is split like a shell would (shlex) and executed directly.

`env` is laid over the agent's own environment (as Ansible's `environment:`
does): commands find PATH and locale as the agent has them, and `env` adds or
overrides variables. With `user`, HOME, USER and LOGNAME are that user's
(unless `env` sets them), as `sudo -H -u` would do. Every command of the
resource (guards, cmd, donecmd, watchcmd) runs as `user`/`group`.

mgmt's per-command fields: `watchshell`/`watchcwd`, `ifshell`/`ifcwd`,
`nifshell`/`nifcwd`, `doneshell`/`donecwd` give that command its own shell and
directory (empty: the resource's `shell` and `cwd`). `ifequals` makes a
successful `ifcmd` hold `cmd` back only while its output (stdout then stderr)
equals that text. `mtimes` forces a run, past every guard, when one of those
files was modified after the last successful run began (kept in the vertex's
state dir); each is watched, and a missing one is an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import time
from pathlib import Path
from typing import Annotated, Any, ClassVar

from evergraph._util.atomic import atomic_write
from evergraph.engine.contract import Handle, Resource, doc, register
from evergraph.errors import ResourceError
from evergraph.resources import _proc
from evergraph.resources._oserror import os_error

#: the commands with their own shell and cwd (mgmt's ifshell, ifcwd, ...)
_OWN_PREFIX = {"watchcmd": "watch", "ifcmd": "if", "nifcmd": "nif", "donecmd": "done"}


@register("exec")
class Exec(Resource, kw_only=True, dict=True, forbid_unknown_fields=True):
    """Runs `cmd`; exit status 0 is success. Guards decide whether it needs to run."""

    cmd: Annotated[str, doc("the command line to run")] = ""
    shell: Annotated[str, doc("run cmd through this shell (e.g. /bin/sh); empty = no shell")] = ""
    cwd: Annotated[str, doc("working directory; empty = the agent's")] = ""
    env: Annotated[dict[str, str], doc("variables laid over the agent's environment")] = {}
    ifcmd: Annotated[str, doc("guard: run cmd only if this command exits 0")] = ""
    creates: Annotated[str, doc("guard: run cmd only if this path does not exist")] = ""
    refresh_only: Annotated[bool, doc("guard: run only when refreshed by a notify edge")] = False
    watchcmd: Annotated[str, doc("long-running command; each line it prints is an event")] = ""
    args: Annotated[
        list[str], doc("arguments for cmd, passed as they are (no shell, no split)")
    ] = []
    nifcmd: Annotated[str, doc("guard: run cmd only if this command exits non-zero")] = ""
    donecmd: Annotated[str, doc("run after cmd succeeded (e.g. to record that it ran)")] = ""
    user: Annotated[
        str, doc("run the commands as this user (name or uid); empty = the agent's")
    ] = ""
    group: Annotated[str, doc("run the commands with this group (name or gid)")] = ""
    watchfiles: Annotated[list[str], doc("absolute paths; a change to any is an event")] = []
    watchshell: Annotated[str, doc("shell for watchcmd; empty = `shell`")] = ""
    watchcwd: Annotated[str, doc("working directory of watchcmd; empty = `cwd`")] = ""
    ifshell: Annotated[str, doc("shell for ifcmd; empty = `shell`")] = ""
    ifcwd: Annotated[str, doc("working directory of ifcmd; empty = `cwd`")] = ""
    ifequals: Annotated[
        str | None,
        doc("with ifcmd: cmd is held back when ifcmd succeeds and prints exactly this"),
    ] = None
    nifshell: Annotated[str, doc("shell for nifcmd; empty = `shell`")] = ""
    nifcwd: Annotated[str, doc("working directory of nifcmd; empty = `cwd`")] = ""
    doneshell: Annotated[str, doc("shell for donecmd; empty = `shell`")] = ""
    donecwd: Annotated[str, doc("working directory of donecmd; empty = `cwd`")] = ""
    mtimes: Annotated[
        list[str],
        doc("absolute paths, watched: one modified since the last run forces a run (no guard)"),
    ] = []

    sends: ClassVar[dict[str, Any]] = {"stdout": str, "stderr": str, "output": str}

    def sent(self) -> dict[str, object]:
        if not self.ran:
            return {}  # a guarded command that did not run sends nothing
        return {"stdout": self.stdout, "stderr": self.stderr, "output": self.output}

    def validate(self) -> None:
        if not self.cmd.strip():
            raise self.bad("cmd", "is empty: say which command to run")
        if self.args and self.shell:
            raise self.bad("args", "cannot be used with shell: put the arguments in cmd")
        for field in ("ifcmd", "nifcmd", "watchcmd", "donecmd", *(() if self.args else ("cmd",))):
            value = getattr(self, field)
            if value and not self._shell(field):
                try:
                    shlex.split(value)
                except ValueError as e:
                    raise self.bad(field, f"cannot be split into arguments: {e}") from None
        if self.creates and not self.creates.startswith("/"):
            raise self.bad("creates", f"{self.creates!r} is not an absolute path")
        for field in ("cwd", "watchcwd", "ifcwd", "nifcwd", "donecwd"):
            value = getattr(self, field)
            if value and not value.startswith("/"):
                raise self.bad(field, f"{value!r} is not an absolute path")
        for field in ("watchfiles", "mtimes"):
            for path in getattr(self, field):
                if not path.startswith("/"):
                    raise self.bad(field, f"{path!r} is not an absolute path")
        if self.ifequals is not None and not self.ifcmd:
            raise self.bad("ifequals", "compares ifcmd's output: it needs an ifcmd")

    def autoedge_wants(self) -> list[list[str]]:
        # the managed file that is this command's program
        try:
            argv = shlex.split(self.cmd) if not self.shell else []
        except ValueError:
            return []
        if argv and argv[0].startswith("/"):
            return [[f"path:{os.path.normpath(argv[0])}"]]
        return []

    async def init(self, handle: Handle) -> None:
        await super().init(handle)
        self.stdout = ""
        self.stderr = ""
        self.output = ""
        self.ran = False

    def _own(self, what: str, setting: str) -> str:
        """The command in field `what`'s own `setting` (`shell`, `cwd`), e.g. ifshell."""
        prefix = _OWN_PREFIX.get(what)
        return str(getattr(self, prefix + setting)) if prefix else ""

    def _shell(self, what: str) -> str:
        """The shell of the command in field `what` (its own, else `shell`)."""
        return self._own(what, "shell") or self.shell

    def _argv(self, line: str, what: str = "cmd") -> list[str]:
        if self.args and line is self.cmd:
            return [self.cmd, *self.args]
        shell = self._shell(what)
        return [shell, "-c", line] if shell else shlex.split(line)

    def _shown(self, line: str) -> str:
        """The command as the log shows it: with its `args` (quoted as a shell would
        need), or as written (a shell script, or a line split like a shell would)."""
        return shlex.join(self._argv(line)) if self.args and line is self.cmd else line

    def watches(self) -> bool:
        # Without watchcmd, watchfiles or mtimes there is nothing to watch: checked
        # at start-up and on refresh only.
        return bool(self.watchcmd or self.watchfiles or self.mtimes)

    async def watch(self) -> None:
        if self.watchcmd and not self.handle.may_run_commands:
            # --noop-no-commands: not even the watch command (its events would only
            # re-check a resource whose guards are not run either)
            self.handle.logger.info("%s: watchcmd not run (--noop-no-commands)", self.ident)
            self.handle.ready()
            await asyncio.Event().wait()
        unsubscribes = [
            self.handle.watcher.subscribe(path, lambda _mask: self.handle.event())
            for path in (*self.watchfiles, *self.mtimes)
        ]
        try:
            self.handle.ready()
            if not self.watchcmd:
                await asyncio.Event().wait()  # events come through the callbacks
            argv = self._argv(self.watchcmd, "watchcmd")
            how = self._as("watchcmd")
            async for _line in _proc.lines(argv, how, self._record_dir()):
                self.handle.event()
        except FileNotFoundError as e:
            raise ResourceError(f"watchcmd: {e.strerror}: {e.filename}") from None
        finally:
            for unsubscribe in unsubscribes:
                unsubscribe()

    async def check_apply(self, apply: bool) -> bool:
        forced = self._outdated()  # mtimes: a file changed since the last run
        if not forced and not apply and not self.handle.may_run_commands:
            if self._held_back_without_commands():
                return True
            guards = [f for f in ("ifcmd", "nifcmd") if getattr(self, f)]
            if guards:  # what they would say is not known without running them
                self.handle.unknown(f"{' and '.join(guards)} not run (--noop-no-commands)")
                return True
        elif not forced and await self._held_back():
            return True
        # what runs, with its arguments (what the vertex knows to be secret is masked)
        ran = shlex.join([self.cmd, *self.args]) if self.args else self.cmd
        self.handle.changed("cmd", None, ran)
        if not apply:
            return False
        began = time.time_ns()
        done = await self._run(self.cmd, "cmd")
        self.stdout, self.stderr = done.stdout, done.stderr
        self.output = done.stdout + done.stderr
        self.ran = True
        if done.returncode != 0:
            tail = (done.stderr.strip() or done.stdout.strip()).splitlines()[-3:]
            detail = (": " + " | ".join(tail)) if tail else ""
            raise ResourceError(f"cmd exited with status {done.returncode}{detail}")
        # an effect: written through to the log before the next one (cli/logs.py)
        self.handle.logger.info(
            "%s: ran %s", self.ident, self._shown(self.cmd), extra={"effect": True}
        )
        if self.donecmd:
            after = await self._run(self.donecmd, "donecmd")
            if after.returncode != 0:
                raise ResourceError(f"donecmd exited with status {after.returncode}")
        if self.mtimes:
            self._ran_at(began)
        return False

    def _held_back_without_commands(self) -> bool:
        """A guard that runs no command (`refresh_only`, `creates`) says cmd must not
        run now."""
        if self.refresh_only and not self.handle.refresh():
            return True
        return bool(self.creates and os.path.lexists(self.creates))

    async def _held_back(self) -> bool:
        """A guard says cmd must not run now."""
        if self._held_back_without_commands():
            return True
        if self.ifcmd:
            guard = await self._run(self.ifcmd, "ifcmd")
            if guard.returncode != 0:
                return True
            if self.ifequals is not None and guard.stdout + guard.stderr == self.ifequals:
                return True
        if self.nifcmd:
            guard = await self._run(self.nifcmd, "nifcmd")
            if guard.returncode == 0:
                return True
        return False

    def _stamp(self) -> Path:
        """Where the start of the last successful run is kept (for mtimes)."""
        try:
            return self.handle.state_dir / "mtimes.ran"
        except OSError as e:
            raise ResourceError(f"mtimes: no state dir to remember the last run: {e}") from None

    def _outdated(self) -> bool:
        """One of `mtimes` was modified after the last successful run began."""
        if not self.mtimes:
            return False
        try:
            ran = int(self._stamp().read_text().strip() or 0)
        except (FileNotFoundError, ValueError):
            ran = -1  # never ran (as far as we know): run
        outdated = False
        for path in self.mtimes:
            try:
                modified = os.stat(path).st_mtime_ns
            except OSError as e:
                raise os_error(f"mtimes: {path}", e) from None
            outdated = outdated or modified > ran
        return outdated

    def _ran_at(self, began: int) -> None:
        with contextlib.suppress(OSError):  # then the next check runs it once more
            atomic_write(self._stamp(), f"{began}\n".encode(), durable=False)

    def _as(self, what: str = "cmd") -> _proc.RunAs:
        cwd = self._own(what, "cwd") or self.cwd
        return _proc.RunAs.resolve(cwd, self.env, self.user, self.group)

    def _record_dir(self) -> Path | None:
        """Where a running command is recorded, for the sweep after a kill -9."""
        try:
            return self.handle.state_dir
        except OSError:
            return None

    async def _run(self, line: str, what: str) -> _proc.Completed:
        logger = self.handle.logger  # masks what the vertex knows to be secret
        on_line: _proc.OnLine | None = None
        if logger.isEnabledFor(_proc.OUTPUT):  # `run -vv`: the output, line by line
            logger.log(_proc.OUTPUT, "%s: %s: %s", self.ident, what, self._shown(line))

            def on_line(stream: str, text: str) -> None:
                logger.log(_proc.OUTPUT, "%s: %s %s: %s", self.ident, what, stream, text)

        try:
            return await _proc.run(
                self._argv(line, what), self._as(what), self._record_dir(), on_line
            )
        except LookupError as e:
            raise ResourceError(str(e)) from None
        except FileNotFoundError as e:
            raise ResourceError(f"{what}: {e.strerror}: {e.filename}") from None
        except PermissionError as e:
            raise ResourceError(f"{what}: {e.strerror}: {e.filename}") from None
