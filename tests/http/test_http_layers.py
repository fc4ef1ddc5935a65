"""The import contract that keeps http/ an adapter: every module of the engine is
either allowed to http (it reads snapshots) or forbidden to it in pyproject.toml,
so a module the engine grows is classified before http can reach it."""

from __future__ import annotations

import pkgutil
import tomllib
from pathlib import Path
from typing import Any

import evergraph.engine

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
CONTRACT = "http reads engine snapshots only: no engine internals, no frontend"
#: what http may import of the engine, and why (pyproject.toml says it too)
ALLOWED = {
    "evergraph.engine.status": "VertexStatus snapshots and the GraphQuery Protocol",
    "evergraph.engine.masking": "status masks a vertex's parameters with it",
    "evergraph.engine.model": "Edge, what GraphQuery.edges returns",
    "evergraph.engine.contract": "the types status and model name",
    "evergraph.engine.services": "the contract's Handle names it (typing only)",
    "evergraph.engine.ahead": "the model names it (typing only: GraphModel.ahead)",
}


def _contract() -> dict[str, Any]:
    config = tomllib.loads(PYPROJECT.read_text())
    contracts = config["tool"]["importlinter"]["contracts"]
    (found,) = [c for c in contracts if c["name"] == CONTRACT]
    return dict(found)


def test_every_engine_module_is_allowed_to_http_or_forbidden_to_it() -> None:
    contract = _contract()
    forbidden = set(contract["forbidden_modules"])
    modules = {
        f"evergraph.engine.{m.name}" for m in pkgutil.iter_modules(evergraph.engine.__path__)
    }
    assert not set(ALLOWED) & forbidden
    assert modules - forbidden - set(ALLOWED) == set(), "classify the new engine module"
    assert set(ALLOWED) <= modules


def test_the_http_contract_forbids_frontends_and_indirect_paths_too() -> None:
    contract = _contract()
    assert contract["type"] == "forbidden"
    assert contract["source_modules"] == ["evergraph.http"]
    assert "evergraph.frontends" in contract["forbidden_modules"]
    assert not contract.get("allow_indirect_imports", False)
    assert "ignore_imports" not in contract
