"""Built-in resource kinds, one module per kind.

Importing this package declares every built-in kind in the default registry by name
only: a kind's module (and what it imports: httpx, D-Bus, ...) is imported on the
first lookup of that kind, so `evergraph check` on a one-file graph imports the file
kind alone. `load_all()` imports them all (for code that wants every class).
A new kind module must be listed in KINDS (tests/agent/test_startup.py checks it)."""

from __future__ import annotations

import importlib
from types import ModuleType

from evergraph.engine.contract import default_registry

#: module (under evergraph.resources) -> the kind names (and aliases) it registers
KINDS: dict[str, tuple[str, ...]] = {
    "augeas": ("augeas",),
    "cron": ("cron",),
    "docker": ("docker:container", "docker:image"),
    "exec": ("exec",),
    "exit_": ("exit",),
    "file": ("file",),
    "gzip": ("gzip",),
    "hostname": ("hostname",),
    "http_client": ("http:client",),
    "kv": ("kv",),
    "line": ("line",),
    "mount": ("mount",),
    "net": ("net",),
    "noop": ("noop",),
    "password": ("password",),
    "pkg": ("pkg",),
    "print": ("print", "msg"),
    "schedule": ("schedule",),
    "ssh_key": ("ssh_authorized_key",),
    "svc": ("svc",),
    "sysctl": ("sysctl",),
    "tar": ("tar",),
    "timer": ("timer",),
    "users": ("user", "group"),
    "value": ("value",),
    "virt": ("virt",),
}

for _module, _names in KINDS.items():
    default_registry.declare(f"{__name__}.{_module}", *_names)


def load_all() -> None:
    """Import every built-in kind's module (registering each kind)."""
    for module in KINDS:
        importlib.import_module(f"{__name__}.{module}")


def __getattr__(name: str) -> ModuleType:
    # `evergraph.resources.file` without an explicit import of the submodule
    if name in KINDS:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
