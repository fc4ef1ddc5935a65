"""The YAML parser gives back what a parse used (frontends/_yaml_rs.py, issue 28):
yaml_rs's own allocator (mimalloc) is told to purge freed pages at once, so a big
parse does not leave its memory in the process for the whole run; the options are
set for the parser's import only (the commands evergraph runs do not inherit them),
and a value the user set is kept."""

from __future__ import annotations

import json
import os
import subprocess
import sys

#: a 10k-resource graph in W1's layout, parsed, dropped; the RSS it left behind
_PROBE = r"""
import json, os, sys
def rss_kb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1])
before_env = dict(os.environ)
from evergraph.frontends.yaml_load import yaml_rs
text = "graph: w1\nresources:\n  file:\n" + "".join(
    f'  - {{name: f{i}, path: "/tmp/w1/d{i // 100}/f{i}.txt", '
    f'content: "# file {i} of 10000\\nkey{i} = value-{i}\\n", mode: "0644", state: exists}}\n'
    for i in range(10_000)
)
yaml_rs.loads("a: 1")
start = rss_kb()
doc = yaml_rs.loads(text)
assert len(doc["resources"]["file"]) == 10_000
del doc
json.dump({"left_kb": rss_kb() - start, "env_same": dict(os.environ) == before_env,
           "purge": os.environ.get("MIMALLOC_PURGE_DELAY")}, sys.stdout)
"""


def _probe(env: dict[str, str]) -> dict[str, object]:
    r = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=False
    )
    assert r.returncode == 0, r.stderr
    out: dict[str, object] = json.loads(r.stdout)
    return out


def test_a_big_parse_leaves_little_memory_behind_and_the_environment_as_it_was() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIMALLOC_")}
    out = _probe(env)
    # (mimalloc's defaults keep ~12 MB of a 10k parse; purged at once, ~1-3 MB)
    assert isinstance(out["left_kb"], int)
    assert out["left_kb"] < 6 * 1024, out
    assert out["env_same"], out  # set for the import only
    assert out["purge"] is None


def test_a_users_own_mimalloc_setting_is_kept() -> None:
    env = {**os.environ, "MIMALLOC_PURGE_DELAY": "1000"}
    out = _probe(env)
    assert out["env_same"], out
    assert out["purge"] == "1000"
