"""`evergraph run`'s work, without click: the click command in cli/main.py and the
console script's fast path (cli/entry.py: `run FILE` with a few common flags,
parsed here) both call `run_command`, so that both say and do the same."""

from __future__ import annotations

import importlib
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from evergraph.cli.common import collector_on, error_line
from evergraph.cli.options import DEFAULTS, ETCD_PASSWORD_ENV, SETTINGS_PARAMS, WORLD_PARAMS
from evergraph.errors import InputError

if TYPE_CHECKING:
    from collections.abc import Callable

    from evergraph.agent.run import Agent, FarmOptions, Service
    from evergraph.world.open import WorldOptions


def die(e: InputError) -> NoReturn:
    print(error_line(e), file=sys.stderr, flush=True)
    sys.exit(2)


def farm_options(
    worker: bool,
    caps: tuple[str, ...],
    groups: tuple[str, ...],
    ssh_port: int,
    ssh_user: str,
    authorized_keys: Path | None,
    farm_servers: tuple[str, ...],
    http_addr: str | None,
    fragment_kinds: str | None = None,
    periods: dict[str, float | None] | None = None,
) -> FarmOptions | None:
    """`periods`: `--farm-job-period` and the like, by FarmSettings field (None: the
    default)."""
    if not worker and (caps or groups or authorized_keys or fragment_kinds):
        raise InputError(
            "--cap, --group, --authorized-keys and --fragment-kinds describe a worker: "
            "add --worker",
            "--worker",
        )
    if farm_servers and not worker and not http_addr:
        raise InputError(
            "--farm-server names the farm servers a worker or an API server (--http) trusts: "
            "add --worker or --http",
            "--farm-server",
        )
    given = {k: v for k, v in (periods or {}).items() if v is not None}
    if given and not http_addr:
        flag = "--farm-" + next(iter(given)).replace("_", "-")
        raise InputError("the farm's periods are for the agents serving it: add --http", flag)
    if not worker and not http_addr:
        return None
    # imported here: an agent outside the farm does not load the farm package
    from evergraph.agent.run import FarmOptions
    from evergraph.farm.facts import parse_caps
    from evergraph.farm.service import FarmSettings
    from evergraph.world.names import hostname_problem

    kinds = tuple(sorted({k.strip() for k in (fragment_kinds or "").split(",") if k.strip()}))
    if kinds:
        from evergraph.frontends.open import builtin_registry

        known = builtin_registry().kinds()
        unknown = [k for k in kinds if k not in known]
        if unknown:
            raise InputError(f"no such resource kind: {', '.join(unknown)}", "--fragment-kinds")
    elif fragment_kinds is not None:
        raise InputError("give kinds separated by commas, e.g. file,exec", "--fragment-kinds")
    settings = None
    if given:
        if "max_prolong" in given:
            given["max_prolong"] = int(given["max_prolong"])
        try:
            settings = FarmSettings(**given)  # type: ignore[arg-type]
        except ValueError as e:
            raise InputError(str(e), "--farm-" + next(iter(given)).replace("_", "-")) from None

    try:
        parsed = parse_caps(caps)
    except ValueError as e:
        raise InputError(str(e), "--cap") from None
    from evergraph.cluster.hostkeys import parse_identity

    names: list[str] = []
    server_keys: dict[str, str] = {}
    for spec in farm_servers:
        h, sep, key = spec.partition("=")
        why = hostname_problem(h)
        if why:
            raise InputError(why, "--farm-server")
        if sep:
            try:
                server_keys[h] = ":".join(parse_identity(key))
            except ValueError as e:
                raise InputError(f"{h}: {e}", "--farm-server") from None
        names.append(h)
    return FarmOptions(
        worker=worker,
        caps=parsed,
        groups=list(groups),
        ssh_port=ssh_port,
        ssh_user=ssh_user,
        authorized_keys=str(authorized_keys.absolute()) if authorized_keys else "",
        key_servers=tuple(names),
        server_keys=server_keys,
        fragment_kinds=kinds,
        matcher=bool(http_addr),
        settings=settings,
    )


def http_service(
    addr: str | None, anonymous: str | None, unix: str | None = None, max_body: int = 1 << 20
) -> Service:
    """The HTTP server as an agent service (on `addr`, and on the Unix socket `unix`);
    the sockets are bound now (InputError)."""
    from evergraph.http.server import HttpServer, bind, bind_unix

    sock = bind(addr) if addr else None
    unix_sock = bind_unix(unix) if unix else None

    async def serve(agent: Agent) -> None:
        from evergraph.farm.service import Farm
        from evergraph.http.app import create_app
        from evergraph.http.farm_api import FarmApi
        from evergraph.http.observe import AgentView

        farm = None
        if agent.kv is not None and agent.farm_trust is not None:
            farm = Farm(
                agent.kv,
                trust=agent.farm_trust,
                host=agent.settings.host(),
                collector=agent.collector,
                settings=agent.farm.settings,  # the matcher's periods and limits, too
                local=agent.worker,
            )
        view = AgentView(agent, farm=farm is not None)
        app = create_app(agent.status, FarmApi(farm, anonymous, check_fragment), view)
        server = HttpServer(app, sock, on_stop=view.close, unix=unix_sock, max_body=max_body)
        await view.serve(server)

    serve.observes = True  # type: ignore[attr-defined]  # metrics and the live view
    return serve


def check_fragment(text: str) -> None:
    """A farm request's graph fragment loads as its worker will load it (else
    InputError): the HTTP API checks each with this, as http imports no frontend."""
    from evergraph.frontends.open import builtin_registry
    from evergraph.frontends.yaml import parse_yaml

    parse_yaml(text, "Fragment", builtin_registry())


def etcd_password(world: dict[str, object]) -> str | None:
    """From --etcd-password-file, else the environment, else --etcd-password (warned:
    a command line is visible to every user of the host)."""
    # Taken out of the environment: the commands the agent runs inherit it.
    env = os.environ.pop(ETCD_PASSWORD_ENV, None)
    given, file = world.get("etcd_password"), world.get("etcd_password_file")
    if given is not None and file is not None:
        raise InputError(
            "give --etcd-password-file or --etcd-password, not both", "--etcd-password"
        )
    if file is not None:
        try:
            with open(str(file), "rb") as f:
                data = f.read(65537)
        except OSError as e:
            raise InputError(f"cannot read {file}: {e.strerror}", "--etcd-password-file") from None
        if len(data) > 65536:
            raise InputError(f"{file} is over 64 KiB: not a password", "--etcd-password-file")
        try:
            password = data.decode().rstrip("\r\n")  # one line, as `echo` writes it
        except UnicodeDecodeError:
            raise InputError(f"{file} is not UTF-8 text", "--etcd-password-file") from None
        if not password:
            raise InputError(f"{file} is empty", "--etcd-password-file")
        return password
    if given is not None:
        print(
            "evergraph: warning: --etcd-password is visible to every user of this host "
            f"(ps): use --etcd-password-file FILE or {ETCD_PASSWORD_ENV}",
            file=sys.stderr,
            flush=True,
        )
        return str(given) or None
    return env or None


#: the kernel's limits on a path (PATH_MAX, with its NUL) and on one name in it (NAME_MAX)
PATH_MAX = 4095
NAME_MAX = 255


def check_path(path: Path | str, flag: str, *, parent_exists: bool = False) -> None:
    """InputError naming `flag` for a path the kernel would refuse, or the current
    directory by accident (an empty value); `parent_exists`: a file the agent writes
    as it runs, whose directory must be there from the start."""
    raw = os.fsencode(path)
    if not raw:
        raise InputError("empty (it would be the current directory): give a path", flag)
    if len(raw) > PATH_MAX:
        raise InputError(
            f"a path of {len(raw)} bytes (starting {os.fsdecode(raw[:40])!r}...): "
            f"at most {PATH_MAX}",
            flag,
        )
    longest = max((len(part) for part in raw.split(b"/")), default=0)
    if longest > NAME_MAX:
        raise InputError(f"a name of {longest} bytes in this path: at most {NAME_MAX}", flag)
    if parent_exists:
        parent = Path(path).parent
        if not parent.is_dir():
            raise InputError(f"{parent} is not a directory (create it first)", flag)


#: seconds past --max-runtime after which the process exits whatever it is doing
MAX_RUNTIME_GRACE = 1.0


def _watchdog(max_runtime: float, flush: Callable[[], None]) -> None:
    """--max-runtime holds on any graph: the engine stops at it (applies cancelled),
    but loading and preparing a graph of 300k resources happens before, in code
    that cannot be interrupted; this thread ends the process `MAX_RUNTIME_GRACE`
    seconds past the limit, counted from the command's start, if it is still
    there. Everything the agent writes survives a kill -9, so exiting at any
    instruction is safe (commands die with the agent)."""
    import threading

    def expire() -> None:
        logging.getLogger("evergraph.agent").error(
            "max runtime of %gs passed %gs ago and the agent has not stopped: "
            "exiting now (exit status 1)",
            max_runtime,
            MAX_RUNTIME_GRACE,
        )
        flush()
        sys.stderr.flush()
        os._exit(1)

    timer = threading.Timer(min(max_runtime + MAX_RUNTIME_GRACE, 1e9), expire)
    timer.daemon = True
    timer.start()


def world_opts(world: dict[str, object]) -> WorldOptions:
    from evergraph.world.open import WorldOptions, seed_problem

    seeds = tuple(u.strip() for u in str(world.get("seeds") or "").split(",") if u.strip())
    for url in seeds:
        why = seed_problem(url)
        if why:
            raise InputError(why, "--seeds")
    for flag in ("etcd_ca", "etcd_cert", "etcd_key"):
        p = world.get(flag)
        if p is not None and not Path(str(p)).is_file():
            raise InputError(f"no such file: {p}", "--" + flag.replace("_", "-"))
    if (world.get("etcd_cert") is None) != (world.get("etcd_key") is None):
        raise InputError("give both --etcd-cert and --etcd-key, or neither", "--etcd-cert")
    backend = str(world.get("world_backend") or "sqlite")
    if backend == "memory" and (seeds or world.get("etcd_mode") == "embedded"):
        raise InputError(
            "an etcd World (--seeds, --etcd embedded) is not a memory World: "
            "drop --world memory, or the etcd flags",
            "--world",
        )
    if world.get("world_db") is not None:
        check_path(Path(str(world["world_db"])), "--world-db")
    embedded = world.get("etcd_mode") == "embedded"
    client_url = str(world.get("etcd_client_url") or "http://127.0.0.1:2379")
    peer_url = str(world.get("etcd_peer_url") or "http://127.0.0.1:2380")
    member_timeout = float(world.get("etcd_member_timeout") or 15.0)  # type: ignore[arg-type]
    if not embedded:
        for flag, given, default in (
            ("--etcd-client-url", client_url, "http://127.0.0.1:2379"),
            ("--etcd-peer-url", peer_url, "http://127.0.0.1:2380"),
            ("--join-token-file", world.get("join_token_file"), None),
            ("--etcd-member-timeout", member_timeout, 15.0),
        ):
            if given != default:
                raise InputError(f"{flag} is for a member: add --etcd embedded", flag)
    else:
        from evergraph.world.open import member_urls_problem

        err = member_urls_problem(client_url, peer_url)
        if err is not None:
            raise err  # before the state dir is made: bad input changes nothing
    token_file = world.get("join_token_file")
    if token_file is not None and not Path(str(token_file)).is_file():
        raise InputError(f"no such file: {token_file}", "--join-token-file")

    def path(k: str) -> Path | None:
        v = world.get(k)
        return Path(str(v)) if v is not None else None

    return WorldOptions(
        backend=backend,
        db=path("world_db"),
        seeds=seeds,
        embedded=embedded,
        client_url=client_url,
        peer_url=peer_url,
        join_token_file=Path(str(token_file)) if token_file is not None else None,
        member_timeout=member_timeout,
        ca=path("etcd_ca"),
        cert=path("etcd_cert"),
        key=path("etcd_key"),
        user=str(world["etcd_user"]) if world.get("etcd_user") else None,
        password=etcd_password(world),
    )


def asyncio_without_tls() -> None:
    """Import asyncio with no `ssl` module for it to load, in a process that opens no
    TLS connection: a run that ends once converged, on the embedded World, with no
    HTTP server and no farm (TLS is etcd's, its member's join wire's). OpenSSL and
    `ssl`'s constants were ~20 ms of such a run's start here, before its children
    may make anything. `ssl` stays importable (only asyncio's own TLS, which this
    process never uses, is off). Nothing done if either is loaded already."""
    if "asyncio" in sys.modules or "ssl" in sys.modules:
        return
    sys.modules["ssl"] = None  # type: ignore[assignment]  # (`import ssl` fails: asyncio does without)
    try:
        import asyncio  # noqa: F401
    finally:
        del sys.modules["ssl"]


def _agent_modules(tls_free: bool) -> None:
    """The modules a run's agent needs, loaded with the GC paused (the console script
    paused it); asyncio without `ssl` if `tls_free` (`asyncio_without_tls`)."""
    if tls_free:
        asyncio_without_tls()
    importlib.import_module("evergraph.agent.api")
    importlib.import_module("evergraph.agent.run")  # (api.run's)
    importlib.import_module("evergraph.cli.progress")


def run_command(params: dict[str, Any]) -> NoReturn:
    """Run the agent with `run`'s parameters (`DEFAULTS` keys), then leave the process
    with its exit status; bad input: one line, exit 2."""
    file: Path | None = params["file"]
    # the engine's settings, by Settings field (an inverted flag: `--no-watch` is watch=False)
    settings: dict[str, Any] = {
        field: (not params[p]) if invert else params[p]
        for p, (field, invert) in SETTINGS_PARAMS.items()
        if field != "state_dir"
    }
    settings["noop"] = settings["noop"] or not settings["noop_commands"]
    state_dir: Path | str | None = params["state_dir"]
    converged_timeout: float | None = params["converged_timeout"]
    converged_status_file: Path | None = params["converged_status_file"]
    max_runtime: float | None = params["max_runtime"]
    graphviz: Path | None = params["graphviz"]
    log_format: str = params["log_format"]
    replace: bool = params["replace"]
    http_addr: str | None = params["http_addr"]
    http_socket: str | None = params["http_socket"]
    http_max_body: int = params["http_max_body"]
    farm_anonymous: str | None = params["farm_anonymous"]
    worker: bool = params["worker"]
    caps: tuple[str, ...] = params["caps"]
    groups: tuple[str, ...] = params["groups"]
    ssh_port: int = params["ssh_port"]
    ssh_user: str = params["ssh_user"]
    authorized_keys: Path | None = params["authorized_keys"]
    farm_servers: tuple[str, ...] = params["farm_servers"]
    fragment_kinds: str | None = params["fragment_kinds"]
    periods = {
        "job_period": params["farm_job_period"],
        "max_prolong": params["farm_max_prolong"],
        "invalid_grace": params["farm_invalid_grace"],
        "alive_grace": params["farm_alive_grace"],
        "election_ttl": params["farm_election_ttl"],
    }
    verbose: int = params["verbose"]
    deployers: tuple[str, ...] = params["deployers"]
    world = {k: params[k] for k in WORLD_PARAMS}
    # (the agent's modules, asyncio's too, load after the checks run ahead have started)
    from evergraph.cli.logs import flush_logs, flusher, setup_logging, terminal_handler
    from evergraph.engine.ahead import JOURNAL, report_made
    from evergraph.engine.settings import check_times, default_state_dir, one_shot
    from evergraph.frontends import early
    from evergraph.frontends.open import frontend_for, trust_deployers

    setup_logging(log_format, verbose)
    started = time.monotonic()  # (--max-runtime counts from here: the watchdog, the agent)
    if max_runtime is not None and max_runtime > 0 and not math.isnan(max_runtime):
        _watchdog(max_runtime, flush_logs)
    try:
        check_times(converged_timeout, max_runtime)
        if state_dir is not None:
            check_path(state_dir, "--state-dir")  # (a str from click: "" is not ".")
            state_dir = Path(state_dir)
        if converged_status_file is not None:
            check_path(converged_status_file, "--converged-status-file", parent_exists=True)
        if graphviz is not None:  # (its directory is made, as for managed files)
            check_path(graphviz, "--graphviz")
        if file is not None:
            check_path(file, "FILE")
        frontend = frontend_for(file)
        if deployers:
            trust_deployers(frontend, deployers)
        frontend.cache_parses(state_dir)
        ends = one_shot(settings)
        if ends:
            frontend.one_shot()

        def agent_modules(opts: WorldOptions) -> None:
            # no TLS in this process: asyncio loads without `ssl`
            _agent_modules(
                ends and not (worker or farm_servers or http_addr or http_socket or opts.is_etcd)
            )

        # while a helper forked at the start parses the graph's resources, if the parse
        # has to wait for it: the agent's modules (else once the checks ahead started)
        early.meanwhile(lambda: agent_modules(world_opts(world)))
        frontend.preload()
        # what a killed run made ahead and never logged: logged now
        journal = (state_dir or default_state_dir()) / JOURNAL
        report_made(journal)
        # a one-shot run checks its files (and makes the missing ones) in a child
        # while it loads the agent; not under noop, nor with a global semaphore
        # (no vertex runs inline), nor in a worker (a job adds to the graph)
        creates = not (settings["noop"] or settings.get("sema", 0) > 0 or worker)
        ahead = frontend.check_ahead(creates, journal) if ends else None
        opts = world_opts(world)
        agent_modules(opts)
        from evergraph.agent.api import run as run_graph
        from evergraph.cli.progress import service as progress_service

        collector_on()  # the console script paused it for the imports
        services = (
            [http_service(http_addr, farm_anonymous, http_socket, http_max_body)]
            if http_addr or http_socket
            else []
        )
        # the live display on a terminal; "still running" lines in a pipe
        services.append(progress_service(terminal_handler()))
        services.append(flusher)  # a pipe's buffered lines, written soon after they come
        farm = farm_options(
            worker,
            caps,
            groups,
            ssh_port,
            ssh_user,
            authorized_keys,
            farm_servers,
            http_addr,
            fragment_kinds,
            periods,
        )
    except InputError as e:
        die(e)
    try:
        status = run_graph(
            frontend,
            **settings,
            state_dir=state_dir,
            world=opts,
            replace=replace,
            deployers=list(deployers),
            services=services,
            farm=farm,
            _started=started,
        )
    finally:
        if ahead is not None:
            ahead.stop()  # (if the run ended before it took the verdicts)
        flush_logs()
        if ahead is not None:
            ahead.forget()  # (all it made is in the log now)
    # The agent has stopped: its World is closed, its children are gone, its writes
    # are on disk. Skip the interpreter's teardown, which would free a big graph
    # object by object (0.6 s for 50k vertices) after SIGTERM asked us to go.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


#: the flags the fast path takes (anything else, `--opt=value` and a repeated flag
#: included, goes to click): flag -> (parameter, kind)
_FLAGS = {
    "--converged-exit": "converged_exit",
    "--converged-report": "converged_report",
    "--noop": "noop",
    "--noop-no-commands": "noop_no_commands",
    "--diff": "diff",
    "--no-watch": "no_watch",
    "--no-autoedges": "no_autoedges",
    "--no-autogroup": "no_autogroup",
}
_VALUED = {
    "--state-dir": "state_dir",
    "--hostname": "hostname",
    "--converged-timeout": "converged_timeout",
    "--max-runtime": "max_runtime",
    "--converged-status-file": "converged_status_file",
    "--log-format": "log_format",
}


def _plain(arg: str) -> bool:
    """A value click would take unchanged: not an option, printable ASCII."""
    return bool(arg) and not arg.startswith("-") and arg.isprintable() and arg.isascii()


def _seconds(arg: str) -> float | None:
    """A plain decimal number (click's float would take more: those go to click)."""
    head, _, tail = arg.partition(".")
    if (head or tail) and (not head or head.isdigit()) and (not tail or tail.isdigit()):
        return float(arg)
    return None


def parse_fast(argv: list[str]) -> dict[str, Any] | None:
    """`run`'s parameters from `argv` (after `run`) when it is FILE and only the
    flags above, each value plain and as click would convert it; None: leave the
    command line to click (its own errors, help, every other option)."""
    params = dict(DEFAULTS)
    seen: set[str] = set()
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg in ("-v", "-vv", "-vvv", "--verbose"):
            params["verbose"] += len(arg) - 1 if arg != "--verbose" else 1
            continue
        if arg in seen:
            return None
        seen.add(arg)
        if arg in _FLAGS:
            params[_FLAGS[arg]] = True
            continue
        if arg in _VALUED:
            if i >= len(argv) or not _plain(argv[i]):
                return None
            value: Any = argv[i]
            i += 1
            name = _VALUED[arg]
            if name in ("converged_timeout", "max_runtime"):
                value = _seconds(value)
                if value is None:
                    return None
            elif name == "log_format":
                if value not in ("text", "json"):
                    return None
            elif name == "state_dir":
                if os.path.exists(value) and not os.path.isdir(value):
                    return None  # click's "is a file"
                value = Path(value)
            elif name == "converged_status_file":
                if os.path.isdir(value):
                    return None  # click's "is a directory"
                value = Path(value)
            params[name] = value
            continue
        if params["file"] is not None or not _plain(arg) or os.path.isdir(arg):
            return None  # a second argument, an option we leave to click, a directory
        params["file"] = Path(arg)
    if params["file"] is None:
        return None  # without FILE: follow deploys (click's)
    return params
