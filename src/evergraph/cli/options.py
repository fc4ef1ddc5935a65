"""`evergraph run`'s options, spelled once: the engine's settings come from the
`Settings` struct's fields (each with its `Flag`: flags, help, type, default); the
agent's own (logging, HTTP, the farm, the World, deploys) are declared here with
the same `Flag`. The click command is generated from `run_options()` (cli/main.py),
the console script's fast path starts from `DEFAULTS` (cli/runner.py). A leaf
without click: the fast path imports it."""

from __future__ import annotations

from typing import Any

from evergraph.engine.settings import Flag, flags

#: where the etcd password may come from, rather than a command line
ETCD_PASSWORD_ENV = "EVERGRAPH_ETCD_PASSWORD"

#: the options that say which World to use (shared by run, world, members, exports)
WORLD_OPTIONS = (
    Flag(
        "--world",
        param="world_backend",
        kind="choice",
        choices=("sqlite", "memory", "etcd"),
        default="sqlite",
        show_default=True,
        help="Where shared state lives: sqlite (a file in the state dir), memory "
        "(this process only), etcd (--seeds or --etcd embedded).",
    ),
    Flag(
        "--world-db",
        kind="path",
        help="The sqlite World's file. [default: STATE_DIR/world.sqlite]",
    ),
    Flag(
        "--seeds",
        default="",
        metavar="URL,...",
        help="etcd client URLs, e.g. https://10.0.0.1:2379 (implies --world etcd).",
    ),
    Flag(
        "--etcd",
        param="etcd_mode",
        kind="choice",
        choices=("embedded",),
        help="Start an etcd server as a child process, data under the state dir.",
    ),
    Flag(
        "--etcd-client-url",
        default="http://127.0.0.1:2379",
        show_default=True,
        metavar="URL",
        help="With --etcd embedded: the client URL this member listens on and advertises "
        "(https:// between hosts).",
    ),
    Flag(
        "--etcd-peer-url",
        default="http://127.0.0.1:2380",
        show_default=True,
        metavar="URL",
        help="With --etcd embedded: the peer URL this member listens on and advertises.",
    ),
    Flag(
        "--join-token-file",
        kind="path",
        help="With --etcd embedded and --seeds: the join token (`evergraph cluster token` "
        "on a member prints one; or set EVERGRAPH_JOIN_TOKEN).",
    ),
    Flag(
        "--etcd-member-timeout",
        kind="float",
        low=1,
        high=3600,
        default=15.0,
        show_default=True,
        metavar="SECONDS",
        help="With --etcd embedded: a voter whose agent is gone and whose member has been "
        "unreachable this long is replaced by a standby.",
    ),
    Flag(
        "--etcd-ca",
        kind="path",
        help="CA certificate that signed the etcd servers' certificates.",
    ),
    Flag("--etcd-cert", kind="path", help="Client certificate for etcd (with --etcd-key)."),
    Flag("--etcd-key", kind="path", help="Client key for etcd."),
    Flag("--etcd-user", help="etcd user name (auth enabled)."),
    Flag(
        "--etcd-password-file",
        kind="path",
        help=f"Read the etcd password from this file (or set {ETCD_PASSWORD_ENV}).",
    ),
    Flag(
        "--etcd-password",
        help="etcd password; visible to every user in `ps`: prefer --etcd-password-file.",
    ),
)

#: the agent's options of `run` between the engine's and the World's
AGENT_OPTIONS = (
    Flag(
        "--log-format",
        kind="choice",
        choices=("text", "json"),
        default="text",
        show_default=True,
        help="Log lines as text or as one JSON object per line.",
    ),
    Flag(
        "--http",
        param="http_addr",
        metavar="ADDR",
        help="Serve the HTTP API on ADDR (HOST:PORT, e.g. 127.0.0.1:9233): health, graph status.",
    ),
    Flag(
        "--http-socket",
        metavar="PATH",
        help="Serve the HTTP API on a Unix socket at PATH too (mode 0666): root's "
        "connections (SO_PEERCRED) read a vertex's parameters without a token; others, "
        "as on --http, need an admin token.",
    ),
    Flag(
        "--http-max-body",
        kind="int",
        low=1024,
        high=1 << 30,
        default=1 << 20,
        show_default=True,
        metavar="BYTES",
        help="With --http: a request body over this many bytes is refused (413) unread.",
    ),
    Flag(
        "--farm-anonymous",
        metavar="GROUP",
        help="With --http: serve tokenless (legacy Boruta) clients as a non-admin user of GROUP.",
    ),
    Flag("--worker", kind="flag", help="Lease this host to farm users (a farm worker)."),
    Flag(
        "--cap",
        param="caps",
        multiple=True,
        metavar="K=V",
        help="A capability of this worker (repeatable); arch, os, cpus, memory_mb and hostname "
        "are discovered.",
    ),
    Flag(
        "--group",
        param="groups",
        multiple=True,
        help="A farm group of this worker (repeatable).",
    ),
    Flag(
        "--ssh-port",
        kind="int",
        low=1,
        high=65535,
        default=22,
        show_default=True,
        help="The sshd port farm users reach this worker on.",
    ),
    Flag(
        "--ssh-user",
        default="root",
        show_default=True,
        help="The account farm users log in as (their job's key is authorized for it).",
    ),
    Flag(
        "--authorized-keys",
        kind="path",
        help="The authorized_keys file a job's key goes to. [default: the --ssh-user's own]",
    ),
    Flag(
        "--farm-server",
        param="farm_servers",
        multiple=True,
        metavar="NAME=KEY",
        help="A farm server (an agent with --http) this worker or API server trusts "
        "(repeatable; this host always is one): KEY as `evergraph hosts key` prints it on "
        "NAME, pinned explicitly. Only farm servers sign the records a worker acts on and "
        "receive its job keys; API servers accept tokens signed by them. NAME alone: only "
        "if `evergraph hosts trust NAME KEY` pinned it already.",
    ),
    Flag(
        "--fragment-kinds",
        metavar="KIND,...",
        help="The resource kinds a request's graph fragment may use on this worker (e.g. "
        "file,pkg); a fragment with another kind is refused, the job runs without it. "
        "[default: any kind]",
    ),
    Flag(
        "--farm-job-period",
        kind="float",
        low=0,
        low_open=True,
        metavar="S",
        help="With --http: a job's length, and what one prolong adds. [default: 3600]",
    ),
    Flag(
        "--farm-max-prolong",
        kind="int",
        low=0,
        metavar="N",
        help="With --http: how many times a job may be prolonged. [default: 3]",
    ),
    Flag(
        "--farm-invalid-grace",
        kind="float",
        low=0,
        metavar="S",
        help="With --http: a waiting request becomes INVALID only after no registered worker "
        "could serve it for S seconds. [default: 60]",
    ),
    Flag(
        "--farm-alive-grace",
        kind="float",
        low=0,
        metavar="S",
        help="With --http: a worker whose agent's lease expired becomes FAILED only after S "
        "seconds more (a slow World fails no live worker). [default: 10]",
    ),
    Flag(
        "--farm-election-ttl",
        kind="float",
        low=0.5,
        metavar="S",
        help="With --http: the farm election's lease; a dead leader's matcher is taken over "
        "within about S seconds. [default: 10]",
    ),
    Flag(
        "--replace",
        kind="flag",
        help="Take the hostname over from another live agent (which then stops).",
    ),
)

#: the options of `run` after the World's
LAST_OPTIONS = (
    Flag(
        "--deployer",
        param="deployers",
        multiple=True,
        metavar="KEY",
        help="Without FILE: run only deploys signed by this verify key (base64, as `evergraph "
        "deploy` prints it; repeatable). [default: the first signer seen, pinned]",
    ),
    Flag(
        "-v",
        "--verbose",
        kind="count",
        help="More log output: -v each check and how long it took, -vv also commands' output.",
    ),
)


def _named(options: tuple[Flag, ...]) -> tuple[Flag, ...]:
    """Each option's parameter (from its long flag unless given) and default (a flag's
    False, a count's 0, a repeatable option's ())."""
    for o in options:
        if not o.param:
            o.param = next(f for f in o.flags if f.startswith("--"))[2:].replace("-", "_")
        if o.kind == "flag":
            o.default = False
        elif o.kind == "count":
            o.default = 0
        elif o.multiple:
            o.default = ()
    return options


_named(WORLD_OPTIONS)
_named(AGENT_OPTIONS)
_named(LAST_OPTIONS)

#: (field, Flag) of the engine's settings: read once, `flags()` evaluates the
#: Settings struct's annotations
_SETTINGS_FLAGS = flags()

#: the engine's settings among `run`'s options: parameter -> (Settings field, whether
#: the flag sets it False: `--no-watch` is watch=False)
SETTINGS_PARAMS = {flag.param: (field, flag.invert) for field, flag in _SETTINGS_FLAGS}


def run_options() -> list[Flag]:
    """Every option of `run`, in the order of its `--help`."""
    return [
        *(flag for _, flag in _SETTINGS_FLAGS),
        *AGENT_OPTIONS,
        *WORLD_OPTIONS,
        *LAST_OPTIONS,
    ]


#: the World's options among them (passed on as `world`)
WORLD_PARAMS = tuple(o.param for o in WORLD_OPTIONS)

#: every parameter of `run` with its default (click's: tests/agent/test_startup.py
#: checks them against the click command's)
DEFAULTS: dict[str, Any] = {"file": None, **{o.param: o.default for o in run_options()}}
