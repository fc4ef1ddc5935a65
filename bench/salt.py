"""Salt on the W1 files workload (issue 28): `salt-call --local state.apply`, masterless.

bench/files.py runs it beside evergraph and the floors when asked (`--with-salt`).
Salt is installed into its own venv, `bench/.venv-salt` (gitignored), made with pip
from bench/salt-requirements.txt on first use (remade when that file changes), never
into the project's .venv: the same mechanism as bench/remote.py's .venv-compare, in a
venv of its own so that Salt's many pinned dependencies and pyinfra/ansible's never
have to agree.

The job is W1 in the *explicit-edge* shape: each of the directories a
`file.directory` state (`makedirs: true`, as evergraph's directory resource and the
floor make missing parents), each file a `file.managed` state with `contents`,
`mode: "0644"` and a `require` on its directory's state, one line each in YAML
flow style (as files.py writes evergraph's graph).

The minion's configuration lives in a temp dir (`--config-dir`) with everything
under `root_dir` (pki, cache, logs: nothing in /etc/salt or /var/cache/salt):

- `file_client: local` (and `--local`): masterless, the SLS from `--file-root`.
- `id: w1-bench`: a fixed minion id, so salt-call does not resolve the host's FQDN
  to name itself; the job does not depend on the id.
- `enable_fqdns_grains: false`: the `fqdns` grain does a reverse DNS lookup of
  every address of the host; nothing in the job reads it. All other grains and
  all modules load as by default (they are Salt's start-up, as imports are
  evergraph's).
- `renderer: yaml`: the SLS has no Jinja; the default `jinja|yaml` would run a
  Jinja pass over the ~1.5 MB file first, which changes nothing.
- `state_verbose: false`, `state_output: terse`: one line per changed or failed
  state instead of a ~20-line block for every state (10k blocks of output are
  formatting, not the job; evergraph logs changes only too).
- `--retcode-passthrough`: a failed state fails the run (and the benchmark, which
  checks every file's content and mode afterwards as for the others anyway).

Each of these makes Salt faster or leaves it unchanged, so the ratios understate,
if anything, how far apart Salt and evergraph are.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.common import REPO, tool_venv

REQUIREMENTS = REPO / "bench" / "salt-requirements.txt"
SALT_VENV = REPO / "bench" / ".venv-salt"
#: the state file's name in the file root: `state.apply w1`
SLS = "w1"


def salt_venv() -> tuple[Path, str]:
    """bench/.venv-salt (`tool_venv`): its bin dir and the version of Salt in it."""
    bin_dir, versions = tool_venv(SALT_VENV, REQUIREMENTS, ("salt",), "files")
    return bin_dir, versions["salt"]


def write_job(work: Path, files: list[tuple[str, str]], mode: str) -> tuple[Path, Path]:
    """The minion config dir and the file root holding `w1.sls`, under `work`."""
    conf, roots, root_dir = work / "salt-conf", work / "salt-roots", work / "salt-root"
    for d in (conf, roots, root_dir):
        d.mkdir()
    (conf / "minion").write_text(
        "\n".join(
            [
                "file_client: local",
                "id: w1-bench",
                f"root_dir: {json.dumps(str(root_dir))}",
                f"file_roots: {{base: [{json.dumps(str(roots))}]}}",
                "enable_fqdns_grains: false",
                "renderer: yaml",
                "state_verbose: false",
                "state_output: terse",
            ]
        )
        + "\n"
    )
    dirs = sorted({path.rsplit("/", 1)[0] for path, _ in files})
    index = {d: j for j, d in enumerate(dirs)}
    lines = [
        f"d{j}: {{file.directory: [{{name: {json.dumps(d)}}}, {{makedirs: true}}]}}"
        for j, d in enumerate(dirs)
    ]
    for i, (path, text) in enumerate(files):
        j = index[path.rsplit("/", 1)[0]]
        lines.append(
            f"f{i}: {{file.managed: [{{name: {json.dumps(path)}}},"
            f' {{contents: {json.dumps(text)}}}, {{mode: "{mode}"}},'
            f" {{require: [{{file: d{j}}}]}}]}}"
        )
    (roots / f"{SLS}.sls").write_text("\n".join(lines) + "\n")
    return conf, roots


def command(bin_dir: Path, conf: Path, roots: Path) -> list[str]:
    return [
        str(bin_dir / "salt-call"),
        "--local",
        f"--config-dir={conf}",
        f"--file-root={roots}",
        "--retcode-passthrough",
        "state.apply",
        SLS,
    ]
