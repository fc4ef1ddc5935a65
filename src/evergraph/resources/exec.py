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
"""

from __future__ import annotations

import asyncio
import os
import shlex
from pathlib import Path
from typing import Annotated, Any, ClassVar

from evergraph.engine.contract import Handle, Resource, doc, register
from evergraph.errors import ResourceError
from evergraph.resources import _proc


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
            if value and not self.shell:
                try:
                    shlex.split(value)
                except ValueError as e:
                    raise self.bad(field, f"cannot be split into arguments: {e}") from None
        if self.creates and not self.creates.startswith("/"):
            raise self.bad("creates", f"{self.creates!r} is not an absolute path")
        if self.cwd and not self.cwd.startswith("/"):
            raise self.bad("cwd", f"{self.cwd!r} is not an absolute path")
        for path in self.watchfiles:
            if not path.startswith("/"):
                raise self.bad("watchfiles", f"{path!r} is not an absolute path")

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

    def _argv(self, line: str) -> list[str]:
        if self.args and line is self.cmd:
            return [self.cmd, *self.args]
        return [self.shell, "-c", line] if self.shell else shlex.split(line)

    def _shown(self, line: str) -> str:
        """The command as the log shows it: with its `args` (quoted as a shell would
        need), or as written (a shell script, or a line split like a shell would)."""
        return shlex.join(self._argv(line)) if self.args and line is self.cmd else line

    def watches(self) -> bool:
        # Without watchcmd or watchfiles there is nothing to watch: checked at
        # start-up and on refresh only.
        return bool(self.watchcmd or self.watchfiles)

    async def watch(self) -> None:
        unsubscribes = [
            self.handle.watcher.subscribe(path, lambda _mask: self.handle.event())
            for path in self.watchfiles
        ]
        try:
            self.handle.ready()
            if not self.watchcmd:
                await asyncio.Event().wait()  # events come through the callbacks
            argv = self._argv(self.watchcmd)
            async for _line in _proc.lines(argv, self._as(), self._record_dir()):
                self.handle.event()
        except FileNotFoundError as e:
            raise ResourceError(f"watchcmd: {e.strerror}: {e.filename}") from None
        finally:
            for unsubscribe in unsubscribes:
                unsubscribe()

    async def check_apply(self, apply: bool) -> bool:
        if self.refresh_only and not self.handle.refresh():
            return True
        if self.creates and os.path.lexists(self.creates):
            return True
        if self.ifcmd:
            guard = await self._run(self.ifcmd, "ifcmd")
            if guard.returncode != 0:
                return True
        if self.nifcmd:
            guard = await self._run(self.nifcmd, "nifcmd")
            if guard.returncode == 0:
                return True
        # what runs, with its arguments (what the vertex knows to be secret is masked)
        ran = shlex.join([self.cmd, *self.args]) if self.args else self.cmd
        self.handle.changed("cmd", None, ran)
        if not apply:
            return False
        done = await self._run(self.cmd, "cmd")
        self.stdout, self.stderr = done.stdout, done.stderr
        self.output = done.stdout + done.stderr
        self.ran = True
        if done.returncode != 0:
            tail = (done.stderr.strip() or done.stdout.strip()).splitlines()[-3:]
            detail = (": " + " | ".join(tail)) if tail else ""
            raise ResourceError(f"cmd exited with status {done.returncode}{detail}")
        self.handle.logger.info("%s: ran %s", self.ident, self._shown(self.cmd))
        if self.donecmd:
            after = await self._run(self.donecmd, "donecmd")
            if after.returncode != 0:
                raise ResourceError(f"donecmd exited with status {after.returncode}")
        return False

    def _as(self) -> _proc.RunAs:
        return _proc.RunAs.resolve(self.cwd, self.env, self.user, self.group)

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
            return await _proc.run(self._argv(line), self._as(), self._record_dir(), on_line)
        except LookupError as e:
            raise ResourceError(str(e)) from None
        except FileNotFoundError as e:
            raise ResourceError(f"{what}: {e.strerror}: {e.filename}") from None
        except PermissionError as e:
            raise ResourceError(f"{what}: {e.strerror}: {e.filename}") from None
