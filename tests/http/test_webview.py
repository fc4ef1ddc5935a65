"""The live web view at `/`, in a real headless Chromium (the system's, driven by
Playwright; no browser download): the vertices are drawn, and a drift repaired
by the agent shows on the edited file's vertex, then fades back."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from playwright import sync_api as playwright

from tests.conftest import Agent, run_cli
from tests.kit.http import api_url

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
#: the page's colours (static/app.js COLOURS)
CLEAN = "#2e9d5b"
REPAIRED = "#d4a72c"


def _fill(page: Any, ident: str) -> str | None:
    return page.evaluate(
        """(ident) => {
            const g = [...document.querySelectorAll("g.vertex")].find(
                (e) => e.dataset.ident === ident);
            return g ? g.querySelector("rect").getAttribute("fill") : null;
        }""",
        ident,
    )


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on this machine")
def test_the_page_shows_a_drift_being_repaired(tmp_path: Path, agents: Any) -> None:
    files = {n: tmp_path / "files" / n for n in ("a", "b", "c")}
    for n, p in files.items():  # already right: every vertex starts clean
        p.parent.mkdir(exist_ok=True)
        p.write_text(f"content of {n}\n")
    g = tmp_path / "g.yaml"
    g.write_text(
        "graph: web\nresources:\n  file:\n"
        + "".join(f'  - name: {p}\n    content: "content of {n}\\n"\n' for n, p in files.items())
        + f"edges:\n- from: {{kind: file, name: {files['a']}}}\n"
        f"  to: {{kind: file, name: {files['b']}}}\n"
    )
    a: Agent = agents(g, tmp_path / "s", "--http", "127.0.0.1:0")
    a.wait_converged()
    url = api_url(a)
    r = run_cli("farm", "token", "create", "root", "--admin", "--state-dir", tmp_path / "s")
    assert r.returncode == 0, r.stderr
    token = r.stdout.strip()
    idents = {n: f"file[{p}]" for n, p in files.items()}
    with playwright.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            # the admin token travels in the fragment (never sent to the server): the
            # page sends it with a vertex's parameters only
            page.goto(url + "/#token=" + token)
            page.wait_for_selector("body[data-ready=true]", timeout=10_000)
            page.wait_for_function(
                "() => document.getElementById('conn').dataset.conn === 'live'", timeout=10_000
            )
            drawn = page.eval_on_selector_all("g.vertex", "gs => gs.map((g) => g.dataset.ident)")
            assert sorted(drawn) == sorted(idents.values())
            assert page.locator("path.edge").count() == 1
            # columns by depth: b (after a) is right of a
            xa = float(page.get_attribute(f'g.vertex[data-ident="{idents["a"]}"] rect', "x") or 0)
            xb = float(page.get_attribute(f'g.vertex[data-ident="{idents["b"]}"] rect', "x") or 0)
            assert xb > xa
            for ident in idents.values():
                assert _fill(page, ident) == CLEAN

            # drift: c edited by hand; its vertex flashes "repaired", then is clean again
            files["c"].write_text("edited by hand\n")
            page.wait_for_function(
                """([ident, colour]) => {
                    const g = [...document.querySelectorAll("g.vertex")].find(
                        (e) => e.dataset.ident === ident);
                    return g && g.querySelector("rect").getAttribute("fill") === colour;
                }""",
                arg=[idents["c"], REPAIRED],
                timeout=10_000,
            )
            assert files["c"].read_text() == "content of c\n"
            assert _fill(page, idents["a"]) == CLEAN  # the others did not move
            page.wait_for_function(
                """([ident, colour]) => {
                    const g = [...document.querySelectorAll("g.vertex")].find(
                        (e) => e.dataset.ident === ident);
                    return g && g.querySelector("rect").getAttribute("fill") === colour;
                }""",
                arg=[idents["c"], CLEAN],
                timeout=10_000,
            )

            # the side panel: the vertex's status and its parameters
            page.click(f'g.vertex[data-ident="{idents["c"]}"]')
            page.wait_for_function(
                "() => document.getElementById('p-params').textContent.includes('content of c')",
                timeout=10_000,
            )
            assert page.text_content("#p-ident") == idents["c"]
            assert page.evaluate("location.hash") == ""  # the token left the address bar
            assert "1 changed" in (page.text_content('#p-status dd[data-field="runs"]') or "")

            # a new graph without c: its vertex leaves the page, with no reload by hand
            entry_c = f'  - name: {files["c"]}\n    content: "content of c\\n"\n'
            assert entry_c in g.read_text()
            g.write_text(g.read_text().replace(entry_c, ""))
            page.wait_for_function(
                "(ident) => ![...document.querySelectorAll('g.vertex')].some("
                "(e) => e.dataset.ident === ident)",
                arg=idents["c"],
                timeout=10_000,
            )
            drawn = page.eval_on_selector_all("g.vertex", "gs => gs.map((g) => g.dataset.ident)")
            assert sorted(drawn) == sorted([idents["a"], idents["b"]])
            assert errors == []
        finally:
            browser.close()
    assert a.stop() == 0
