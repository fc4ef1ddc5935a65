"""Start-up stays cheap: kinds load on first use, and `evergraph check` imports
neither asyncio, ssl nor httpx (issue 15 item 3)."""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import evergraph.resources
from evergraph.engine.contract import Registry, Resource, default_registry
from tests.kit.pki import make_pki

RESOURCES = Path(evergraph.resources.__file__).parent


def _registered_kinds(module: Path) -> set[str]:
    """The kind names a module's `@register(...)` decorators name, read from source."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "register":
            names |= {a.value for a in node.args if isinstance(a, ast.Constant)}
    return names


def test_every_kind_module_is_declared_with_every_name_it_registers() -> None:
    declared = {m: set(k) for m, k in evergraph.resources.KINDS.items()}
    found = {
        p.stem: kinds for p in sorted(RESOURCES.glob("*.py")) if (kinds := _registered_kinds(p))
    }
    assert found, "no @register found: the scan is broken"
    assert declared == found


def test_a_lazy_kind_is_imported_on_first_lookup_and_listed_before() -> None:
    code = (
        "import sys, evergraph.resources\n"
        "from evergraph.engine.contract import default_registry as r\n"
        "before = 'evergraph.resources.http_client' in sys.modules\n"
        "listed = 'http:client' in r.kinds() and 'msg' in r.kinds()\n"
        "cls = r.get('http:client')\n"
        "print(before, listed, cls.kind, 'evergraph.resources.http_client' in sys.modules,"
        " r.get('msg').kind, r.get('nosuch'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["False", "True", "http:client", "True", "print", "None"]


def test_a_copy_taken_before_loading_gets_the_class() -> None:
    copy = default_registry.copy()
    cls = copy.get("noop")
    assert cls is not None
    assert issubclass(cls, Resource)
    assert cls is default_registry.get("noop")
    assert set(copy.kinds()) == set(default_registry.kinds())


def test_an_own_registry_is_not_lazy() -> None:
    assert Registry().get("file") is None
    assert Registry().kinds() == []


def test_load_all_registers_every_declared_kind() -> None:
    evergraph.resources.load_all()
    for names in evergraph.resources.KINDS.values():
        for name in names:
            assert name in default_registry._kinds


def _python(code: str) -> subprocess.CompletedProcess[str]:
    """`python -c code` in a process of its own, which must succeed."""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    return p


def _modules_after(*argv: str) -> set[str]:
    code = (
        "import sys, json, runpy\n"
        f"sys.argv = {['evergraph', *argv]!r}\n"
        "try:\n"
        "    runpy.run_module('evergraph.cli.main', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    assert not e.code, e.code\n"
        "print(json.dumps(sorted(sys.modules)), file=sys.stderr)\n"
    )
    return set(json.loads(_python(code).stderr.strip().splitlines()[-1]))


def test_check_of_a_one_file_graph_imports_only_the_file_kind(tmp_path: Path) -> None:
    g = tmp_path / "g.yaml"
    g.write_text(f"resources:\n  file:\n  - name: f\n    path: {tmp_path}/x\n    content: hi\n")
    mods = _modules_after("check", str(g))
    assert "evergraph.resources.file" in mods
    kinds = {m for m in mods if m.startswith("evergraph.resources.") and m[20:21] != "_"}
    assert kinds == {"evergraph.resources.file"}
    for heavy in (
        *("httpx", "asyncio", "ssl", "evergraph.cli.world", "evergraph.world.etcd"),
        "ctypes",  # inotify's calls: when a hub starts
    ):
        assert heavy not in mods, heavy


def _modules_at_exit(*argv: str) -> set[str]:
    """`sys.modules` when `evergraph ARGV` leaves through `os._exit` (as `run` does)."""
    code = (
        "import sys, os, runpy\n"
        "real = os._exit\n"
        "def _exit(status):\n"
        "    mods = sorted(sys.modules)\n"
        "    import json\n"
        "    print(json.dumps(mods), file=sys.stderr, flush=True)\n"
        "    real(status)\n"
        "os._exit = _exit\n"
        f"sys.argv = {['evergraph', *argv]!r}\n"
        "runpy.run_module('evergraph.cli.main', run_name='__main__')\n"
    )
    return set(json.loads(_python(code).stderr.strip().splitlines()[-1]))


def test_run_of_a_yaml_graph_outside_the_farm_imports_no_farm_python_frontend_or_http(
    tmp_path: Path,
) -> None:
    g = tmp_path / "g.yaml"
    g.write_text(f"resources:\n  file:\n  - name: f\n    path: {tmp_path}/x\n    content: hi\n")
    st = tmp_path / "state"
    mods = _modules_at_exit("run", str(g), "--converged-exit", "--state-dir", str(st))
    assert (tmp_path / "x").read_text() == "hi"
    assert "evergraph.agent.run" in mods
    assert "evergraph.world.sqlite" in mods
    for heavy in (
        "evergraph.farm",  # the farm package: --worker or --http only
        "evergraph.farm.host",
        "cryptography",  # the farm worker's RSA job keys
        "evergraph.frontends.python",  # .py graphs only
        "evergraph.http",  # --http only
        "httpx",
        "grpc",  # the etcd World only
        "evergraph.world.etcd",
        "ctypes",  # inotify's calls: a one-shot run makes no instance
        "asyncinotify",
        "ssl",  # TLS: the etcd World's, or a member's (cli/runner.asyncio_without_tls)
        "_ssl",
    ):
        assert heavy not in mods, heavy


def test_asyncio_without_tls_leaves_ssl_importable_and_asyncio_with_tls_otherwise() -> None:
    """What a one-shot run on the embedded World does: asyncio loaded with no `ssl`
    (its TLS off in that process), `ssl` itself importable after; where ssl or
    asyncio is loaded already, nothing changes. A run on etcd keeps asyncio's TLS."""
    code = (
        "import sys\n"
        "from evergraph.cli.runner import asyncio_without_tls\n"
        "asyncio_without_tls()\n"
        "import asyncio.base_events, asyncio.sslproto\n"
        "assert asyncio.base_events.ssl is None and asyncio.sslproto.ssl is None\n"
        "assert 'ssl' not in sys.modules\n"
        "import ssl\n"
        "ssl.create_default_context()\n"
        "print('ok')\n"
    )
    assert _python(code).stdout == "ok\n"
    code = (
        "import ssl\n"
        "from evergraph.cli.runner import asyncio_without_tls\n"
        "asyncio_without_tls()\n"
        "import asyncio.base_events\n"
        "assert asyncio.base_events.ssl is ssl\n"
    )
    _python(code)
    from evergraph.cli.runner import world_opts

    # (the World options that keep asyncio's TLS: an etcd World, client or member)
    assert world_opts({"seeds": "http://127.0.0.1:2379"}).is_etcd
    assert world_opts({"etcd_mode": "embedded"}).is_etcd
    assert not world_opts({"seeds": None, "etcd_mode": None, "world_backend": "memory"}).is_etcd


def test_a_kinds_own_tls_works_where_asyncio_was_loaded_without_it(tmp_path: Path) -> None:
    """What `asyncio_without_tls` leaves a one-shot run: only asyncio's own TLS (a
    member's join wire, never in such a run) is off; a kind's HTTPS (http:client's
    httpx, on anyio) still fetches, and checks the server's certificate."""
    pki = make_pki(tmp_path / "pki")
    code = f"""
from evergraph.cli.runner import asyncio_without_tls
asyncio_without_tls()
import asyncio, asyncio.base_events, http.server, threading
assert asyncio.base_events.ssl is None
import ssl, httpx
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "5"); self.end_headers()
        self.wfile.write(b"hello")
    def log_message(self, *a):
        pass
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain({str(pki / "server.pem")!r}, {str(pki / "server-key.pem")!r})
server.socket = ctx.wrap_socket(server.socket, server_side=True)
threading.Thread(target=server.serve_forever, daemon=True).start()
url = f"https://127.0.0.1:{{server.server_address[1]}}/x"
async def get(verify):
    async with httpx.AsyncClient(verify=verify) as client:
        return (await client.get(url)).content
print(asyncio.run(get(ssl.create_default_context(cafile={str(pki / "ca.pem")!r}))).decode())
try:
    asyncio.run(get(True))  # (the system's CAs: ours is not among them)
except httpx.ConnectError as e:
    print("refused:", "CERTIFICATE_VERIFY_FAILED" in str(e))
server.shutdown()
"""
    assert _python(code).stdout == "hello\nrefused: True\n"


ENTRY = [sys.executable, "-m", "evergraph.cli.entry"]  # the console script's main
CLICK = [sys.executable, "-m", "evergraph.cli.main"]  # the click application's


def test_the_console_script_is_the_entry_module() -> None:
    from importlib.metadata import entry_points

    (script,) = entry_points(group="console_scripts", name="evergraph")
    assert script.value == "evergraph.cli.entry:main"


def test_check_file_is_answered_without_click(tmp_path: Path) -> None:
    g = tmp_path / "g.yaml"
    g.write_text(f"resources:\n  file:\n  - name: f\n    path: {tmp_path}/x\n    content: hi\n")
    code = (
        "import sys, runpy\n"
        f"sys.argv = ['evergraph', 'check', {str(g)!r}]\n"
        "try:\n"
        "    runpy.run_module('evergraph.cli.entry', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    assert not e.code, e.code\n"
        "mods = sorted(sys.modules)\n"
        "import json\n"
        "print(json.dumps(mods), file=sys.stderr)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "is valid: 1 resources (file: 1)" in p.stdout
    mods = set(json.loads(p.stderr.strip().splitlines()[-1]))
    assert "evergraph.resources.file" in mods
    assert "click" not in mods
    assert "evergraph.cli.main" not in mods


def _both(*args: str) -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str]]:
    def one(cmd: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=60)

    return one(ENTRY), one(CLICK)


def test_check_says_the_same_with_and_without_click(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(
        "resources:\n  file:\n  - name: f\n    path: /tmp/x\n    content: hi\n"
        "  noop:\n  - name: n\n"
    )
    bad = tmp_path / "bad.yaml"
    bad.write_text("resources:\n  file:\n  - name: f\n    path: /tmp/x\n    content: [1]\n")
    evil_name = tmp_path / "e\x1b[31m.yaml"  # a terminal escape: click's own path
    evil_name.write_text(good.read_text())
    said = {}
    for args in (
        ("check", str(good)),
        ("check", f"{tmp_path}/./good.yaml"),
        ("check", str(bad)),
        ("check", str(tmp_path / "missing.yaml")),
        ("check", str(tmp_path)),  # a directory: click's error
        ("check", str(evil_name)),
        ("check", "--", str(good)),
        ("check", "--help"),
        ("--help",),
    ):
        fast, slow = said[args] = _both(*args)
        assert (fast.returncode, fast.stdout, fast.stderr) == (
            slow.returncode,
            slow.stdout,
            slow.stderr,
        ), args
    # (the runs above, not new ones)
    fast, _ = said["check", str(good)]
    assert fast.returncode == 0
    assert "is valid: 2 resources (file: 1, noop: 1), 0 edges" in fast.stdout
    fast, _ = said["check", str(bad)]
    assert fast.returncode == 2
    assert fast.stderr.startswith(f"evergraph: {bad}:5:")
    assert fast.stderr.count("\n") == 1
    fast, _ = said["check", str(tmp_path)]
    assert fast.returncode == 2
    assert "is a directory" in fast.stderr


def test_the_lazy_commands_table_names_what_each_module_registers() -> None:
    import importlib

    import click

    from evergraph.cli import main

    found: dict[str, str] = {}
    for module in set(main.LAZY_COMMANDS.values()):
        g = click.Group()
        mod = importlib.import_module(f"evergraph.cli.{module}")
        if module == "setup":
            g.add_command(main.run)
            mod.register(g)
            del g.commands["run"]
        else:
            mod.register(g, main.world_options)
        found |= dict.fromkeys(g.commands, module)
    assert found == main.LAZY_COMMANDS


def test_a_lazy_command_runs_and_is_listed_in_help() -> None:
    from click.testing import CliRunner

    from evergraph.cli.main import LAZY_COMMANDS, cli

    runner = CliRunner()
    r = runner.invoke(cli, ["--help"])
    assert r.exit_code == 0, r.output
    listed = {line.split()[0] for line in r.output.split("Commands:")[1].splitlines() if line}
    assert set(LAZY_COMMANDS) <= listed
    r = runner.invoke(cli, ["members", "--help"])
    assert r.exit_code == 0, r.output
    assert "Usage: evergraph members" in r.output or "members [OPTIONS]" in r.output


def test_the_watch_bits_are_the_kernels() -> None:
    from asyncinotify import Mask

    from evergraph.watch import inotify

    for name in ("MODIFY", "ATTRIB", "CLOSE_WRITE", "MOVED_FROM", "MOVED_TO", "CREATE"):
        assert getattr(inotify, f"IN_{name}") == int(getattr(Mask, name)), name
    for name in ("DELETE", "DELETE_SELF", "MOVE_SELF", "Q_OVERFLOW", "IGNORED", "ONLYDIR"):
        assert getattr(inotify, f"IN_{name}") == int(getattr(Mask, name)), name


def _at_exit(argv: list[str], module: str = "evergraph.cli.entry") -> tuple[int, str, set[str]]:
    """Run `evergraph ARGV` through `module` in a subprocess: (status, stderr, the
    modules imported, "<an inotify instance>" if it made one, "<the cyclic GC off>"
    if the collector was off when it left, "<dataclass M.C>" for each dataclass C
    an imported module M of evergraph defines, "<decoder M.D>" for each msgspec
    decoder D of M made: at import, or by D() once (functools.cache))."""
    code = (
        "import sys, os, runpy\n"
        "from evergraph._util import inotify\n"
        "made, init = [], inotify.Inotify.__init__\n"
        "def counted(self):\n"
        "    init(self)\n"
        "    made.append(self.fd)\n"
        "inotify.Inotify.__init__ = counted\n"
        "real = os._exit\n"
        "def _exit(status):\n"
        "    mods = sorted(sys.modules)\n"
        "    if made:\n"
        "        mods.append('<an inotify instance>')\n"
        "    import gc\n"
        "    if not gc.isenabled():\n"
        "        mods.append('<the cyclic GC off>')\n"
        "    for name, m in list(sys.modules.items()):\n"
        "        if name.startswith('evergraph'):\n"
        "            for k, v in vars(m).items():\n"
        "                if isinstance(v, type) and v.__module__ == name and "
        "'__dataclass_fields__' in v.__dict__:\n"
        "                    mods.append(f'<dataclass {name}.{k}>')\n"
        "                built = getattr(v, 'cache_info', None)\n"
        "                if 'Decoder' in type(v).__name__ or (\n"
        "                    k.endswith('_decoder') and built and built().currsize\n"
        "                ):\n"
        "                    mods.append(f'<decoder {name}.{k}>')\n"
        "    import json\n"
        "    print(json.dumps(mods), file=sys.stderr, flush=True)\n"
        "    real(status)\n"
        "os._exit = _exit\n"
        f"sys.argv = {['evergraph', *argv]!r}\n"
        f"runpy.run_module({module!r}, run_name='__main__')\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    return p.returncode, p.stderr, set(json.loads(p.stderr.strip().splitlines()[-1]))


def test_run_file_is_answered_without_click_and_a_one_shot_run_opens_no_inotify(
    tmp_path: Path,
) -> None:
    g = tmp_path / "g.yaml"
    g.write_text(f"resources:\n  file:\n  - name: f\n    path: {tmp_path}/x\n    content: hi\n")
    st = str(tmp_path / "state")
    rc, err, mods = _at_exit(["run", str(g), "--converged-exit", "--state-dir", st])
    assert rc == 0, err
    assert (tmp_path / "x").read_text() == "hi"
    assert "evergraph.world.sqlite" in mods  # the World was used (members, host keys)
    for heavy in ("click", "evergraph.cli.main", "asyncinotify", "<an inotify instance>"):
        assert heavy not in mods, heavy
    # the console script pauses the collector for the imports only: on for the agent
    assert "<the cyclic GC off>" not in mods
    # a run that goes on after converging watches its files (the hub's instance)
    rc, err, mods = _at_exit(["run", str(g), "--no-watch", "--state-dir", st, "--max-runtime", "5"])
    assert rc == 0, err
    assert "click" not in mods
    rc, err, mods = _at_exit(
        ["run", str(g), "--converged-exit", "--converged-timeout", "0.01", "--state-dir", st]
    )
    assert rc == 0, err
    assert "<an inotify instance>" in mods
    assert "click" not in mods
    # an option the fast path leaves to click
    rc, err, mods = _at_exit(["run", str(g), "--converged-exit", "--sema", "2", "--state-dir", st])
    assert rc == 0, err
    assert "click" in mods


#: what differs between two runs of the same command: times of day, durations, pids
_STAMP = re.compile(r"\d+(\.\d+)?")


@pytest.mark.slow
def test_run_says_and_does_the_same_with_and_without_click(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(
        f"resources:\n  file:\n  - name: f\n    path: {tmp_path}/out\n    content: hi\n"
        "  noop:\n  - name: n\n"
    )
    bad = tmp_path / "bad.yaml"
    bad.write_text("resources:\n  file:\n  - name: f\n    path: /tmp/x\n    content: [1]\n")
    failing = tmp_path / "failing.yaml"
    failing.write_text(f"resources:\n  exec:\n  - name: e\n    cmd: {tmp_path}/no-such-program\n")
    py = tmp_path / "site.py"
    py.write_text(
        "def graph(g, world):\n"
        f"    g.add('file', 'p', path={str(tmp_path / 'out')!r}, content='from python')\n"
    )
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    st = str(tmp_path / "state")
    # the command lines the fast path takes: each run by both executables
    cases = [
        ("run", str(good), "--converged-exit", "--state-dir", st),
        ("run", str(good), "--converged-exit", "--state-dir", st, "--noop"),
        ("run", "--noop", "--state-dir", st, str(good), "--converged-exit", "-v"),
        ("run", str(good), "--no-watch", "--state-dir", st, "--log-format", "json"),
        ("run", str(good), "--converged-exit", "--state-dir", st, "--diff", "-vv"),
        ("run", str(good), "--converged-exit", "--converged-timeout", "0.05", "--state-dir", st),
        ("run", str(good), "--converged-exit", "--max-runtime", "0", "--state-dir", st),
        ("run", str(good), "--converged-exit", "--hostname", "bad_name!", "--state-dir", st),
        ("run", str(bad), "--converged-exit", "--state-dir", st),
        ("run", str(failing), "--converged-exit", "--state-dir", st),
        ("run", str(tmp_path / "missing.yaml"), "--converged-exit", "--state-dir", st),
        ("run", str(py), "--converged-exit", "--state-dir", st),
        (
            "run",
            str(good),
            "--converged-exit",
            "--state-dir",
            st,
            "--converged-status-file",
            str(tmp_path / "status"),
        ),
        ("run", str(good), "--noop", "--no-watch", "--state-dir", st, "--hostname", "h1"),
    ]
    # the command lines the fast path leaves to click (its parse, its errors, its help):
    # the console script then runs the click application on the same argv
    deferred = [
        ("run", str(good), "--converged-exit", "--bogus", "--state-dir", st),
        ("run", str(good), "--converged-exit", "--converged-timeout", "-1", "--state-dir", st),
        ("run", str(good), "--converged-exit", "--converged-timeout", "1e400", "--state-dir", st),
        ("run", str(good), "--converged-exit", "--converged-timeout", "soon", "--state-dir", st),
        ("run", str(good), "--converged-exit", "--log-format", "xml", "--state-dir", st),
        ("run", str(good), "--converged-exit", "--state-dir", str(a_file)),
        ("run", str(good), "--converged-exit", "--state-dir"),
        ("run", str(good), "--converged-exit", "--converged-exit", "--state-dir", st),
        ("run", str(good), str(good), "--converged-exit", "--state-dir", st),
        ("run", str(tmp_path), "--converged-exit", "--state-dir", st),  # a directory
        ("run", str(good), "--converged-exit", "--converged-status-file", str(tmp_path)),
        ("run", "--help"),
    ]
    from evergraph.cli.runner import parse_fast

    for args in cases:
        assert parse_fast(list(args[1:])) is not None, args  # the fast path takes it
    for args in deferred:
        assert parse_fast(list(args[1:])) is None, args

    def fresh() -> None:  # each command on the same machine state
        shutil.rmtree(st, ignore_errors=True)
        (tmp_path / "out").unlink(missing_ok=True)
        (tmp_path / "status").unlink(missing_ok=True)

    said = []
    for args in [*cases, *deferred]:
        fresh()
        fast = subprocess.run([*ENTRY, *args], capture_output=True, text=True, timeout=60)
        out = (tmp_path / "out").exists()
        status = (tmp_path / "status").read_text() if args[-1].endswith("status") else ""
        fresh()
        slow = subprocess.run([*CLICK, *args], capture_output=True, text=True, timeout=60)
        assert fast.returncode == slow.returncode, (args, fast.stderr, slow.stderr)
        assert fast.stdout == slow.stdout, args
        assert _STAMP.sub("T", fast.stderr) == _STAMP.sub("T", slow.stderr), args
        assert out == (tmp_path / "out").exists(), args
        if status:
            assert status.endswith("true\n")
            assert status == (tmp_path / "status").read_text()
        said.append(fast)
    assert said[0].returncode == 0, said[0].stderr
    assert "converged: 2 vertices clean, 1 changed" in said[0].stderr
    assert said[1].returncode == 3  # --noop: something would change
    assert said[8].returncode == 2
    assert said[8].stderr.startswith(f"evergraph: {bad}:5:")
    assert said[9].returncode == 1
    bogus, negative = said[len(cases)], said[len(cases) + 1]
    assert bogus.returncode == 2
    assert "--bogus" in bogus.stderr  # click's own error
    assert negative.returncode == 2
    assert "--converged-timeout" in negative.stderr


def test_the_fast_run_path_starts_from_clicks_defaults() -> None:
    from evergraph.cli import main, runner

    ctx = main.run.make_context("run", [])
    assert ctx.params == runner.DEFAULTS
    for flag, name in {**runner._FLAGS, **runner._VALUED}.items():
        (opt,) = [p for p in main.run.params if flag in p.opts]
        assert opt.name == name, flag


def test_a_lazy_hub_makes_its_instance_on_the_first_subscription(tmp_path: Path) -> None:
    import asyncio
    import contextlib

    from evergraph.watch import InotifyHub

    async def main() -> list[int]:
        seen: asyncio.Queue[int] = asyncio.Queue()
        async with InotifyHub(lazy=True) as hub:
            pump = asyncio.create_task(hub.run())
            try:
                await asyncio.sleep(0)  # run() waits: no instance yet
                assert hub._ino is None
                assert not pump.done()
                unsubscribe = hub.subscribe(str(tmp_path / "f"), seen.put_nowait)
                assert hub._ino is not None
                (tmp_path / "f").write_text("x")
                masks = [await asyncio.wait_for(seen.get(), 10)]
                unsubscribe()
                return masks
            finally:
                pump.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pump

    (mask, *_) = asyncio.run(main())
    from evergraph.watch import inotify

    assert mask & (inotify.IN_CREATE | inotify.IN_MODIFY | inotify.IN_CLOSE_WRITE)


def test_a_one_shot_run_of_half_a_second_arms_no_notifier_of_the_world(tmp_path: Path) -> None:
    """A run that exits once converged tells the sqlite World it ends soon: its
    notifier of other processes' commits arms after SHORT_LIVED_ARM_AFTER, not
    ARM_AFTER, so that a run done within that time makes no inotify instance
    (whose teardown costs ~15 ms at exit). A command of half a second: longer than
    ARM_AFTER."""
    from evergraph.world import _sqlite_notify

    assert _sqlite_notify.ARM_AFTER < 0.5 < _sqlite_notify.SHORT_LIVED_ARM_AFTER
    g = tmp_path / "g.yaml"
    g.write_text("resources:\n  exec:\n  - name: e\n    cmd: sleep 0.5\n    shell: /bin/sh\n")
    st = str(tmp_path / "state")
    rc, err, mods = _at_exit(["run", str(g), "--converged-exit", "--state-dir", st])
    assert rc == 0, err
    assert "evergraph.world.sqlite" in mods  # (the World was used: members, host keys)
    assert "<an inotify instance>" not in mods


def test_a_sqlite_watcher_sees_another_clients_commit_made_before_its_notifier_is_armed(
    tmp_path: Path,
) -> None:
    """The notifier arms its inotify instance ARM_AFTER after the first watch: a
    commit by another client (process) in that moment is not lost."""
    import asyncio

    from evergraph.world import sqlite

    async def main() -> list[str]:
        mine = sqlite.SQLiteKV(tmp_path / "world.sqlite")
        other = sqlite.SQLiteKV(tmp_path / "world.sqlite")  # another client's connection
        try:
            _, rev = await mine.range("k/")
            events = mine.watch("k/", rev + 1)
            first = asyncio.ensure_future(anext(events))
            await asyncio.sleep(0)  # the watch reads, finds nothing, waits
            await other.put("k/a", b"1")  # its own notify does not reach `mine`
            # seen once armed (without the look after arming: at the 30 s poll)
            batch = await asyncio.wait_for(first, 10)
            await events.aclose()
            return [e.key for e in batch]
        finally:
            await mine.close()
            await other.close()

    assert asyncio.run(main()) == ["k/a"]


def test_a_one_shot_run_from_the_parse_cache_imports_no_parser(tmp_path: Path) -> None:
    """An unchanged re-run takes its model from the parse cache: the modules around
    the YAML parser (yaml_rs itself loads with frontends.yaml, in the main thread:
    see there), the builder of resources from data (engine.build) and what only
    an unprintable log character needs (unicodedata) are not imported (issue 28:
    the imports a one-shot run pays). The first run, which parses, has them;
    difflib (a hint in an error) neither has."""
    g = tmp_path / "g.yaml"
    g.write_text(
        f"resources:\n  file:\n  - name: d\n    path: {tmp_path}/d/\n    state: exists\n"
        f"  - name: f\n    path: {tmp_path}/d/x\n    content: hi\n"
        "edges:\n- name: e\n  from:\n    kind: file\n    name: d\n"
        "  to:\n    kind: file\n    name: f\n"
    )
    st = str(tmp_path / "state")
    argv = ["run", str(g), "--converged-exit", "--state-dir", st]
    parser = (
        "evergraph.frontends.yaml_edges",
        "evergraph.frontends.yaml_load",
        "evergraph.engine.build",
    )
    rc, err, first = _at_exit(argv)
    assert rc == 0, err
    assert (tmp_path / "d" / "x").read_text() == "hi"
    assert set(parser) <= first
    assert "difflib" not in first  # (loaded for an error's hint only)
    rc, err, again = _at_exit(argv)
    assert rc == 0, err
    assert "evergraph.world.sqlite" in again  # the World was opened and joined
    assert "evergraph.frontends.yaml" in again
    # nor what only a new World's id (secrets), a record of the store or a pins
    # file (json), a follower's backoff (random), another host's export index
    # (pairindex) or a removed tree or a command (shutil) need
    for deferred in (
        *(*parser, "difflib", "unicodedata", "secrets", "json"),
        *("random", "evergraph.cluster.exports.pairindex"),
        *("shutil", "bz2", "lzma"),  # (rmtree and which: a removal, a command)
    ):
        assert deferred not in again, deferred
    # a dataclass compiles its generated methods at import (~0.7-1.4 ms each):
    # what every run imports declares Structs or plain classes instead (the
    # frontends' Context, the sqlite notifier's view of its client)
    assert {m for m in again if m.startswith("<dataclass ")} <= {
        "<dataclass evergraph.engine.model.GraphModel>",
        "<dataclass evergraph.world.open.WorldOptions>",
    }
    # a msgspec decoder resolves its type's annotations when made (~0.1-0.3 ms):
    # those of the records a run that is sent no export never decodes are made on
    # first use
    assert "<decoder evergraph.frontends.cache._entry_decoder>" in again  # (seen)
    for decoder in (
        "evergraph.cluster.exports.record._decoder",
        "evergraph.cluster.exports.index._index_decoder",
        "evergraph.cluster.exports.index._bucket_decoder",
    ):
        assert f"<decoder {decoder}>" not in again, decoder
