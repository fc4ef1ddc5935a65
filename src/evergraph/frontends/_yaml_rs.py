"""The YAML parser (`yaml_rs`), loaded with its allocator told to give memory back.

yaml_rs brings its own allocator, mimalloc, which by default commits its arenas
eagerly and keeps the pages a parse freed for later, purging them only at its
next allocation past a delay. Python's allocator never reuses them: a parse of
W1's 10k-resource graph left ~12 MB of the process's RSS behind, for the whole
run (issue 28). Told to purge at once and commit on demand, mimalloc gives them
back (a 10k parse: 42 -> 28 MB RSS at its peak, 35 -> 22 MB after; its CPU the
same within noise).

mimalloc reads these options from the environment once, when the library loads:
they are set for the import only (a value the user set is left alone), so the
commands evergraph runs do not inherit them. Every frontend module imports the
parser from here; nothing else in evergraph imports yaml_rs.
"""

from __future__ import annotations

import os

#: mimalloc's options (https://microsoft.github.io/mimalloc/environment.html)
MIMALLOC_OPTIONS = {"MIMALLOC_PURGE_DELAY": "0", "MIMALLOC_ARENA_EAGER_COMMIT": "0"}

_set = [k for k in MIMALLOC_OPTIONS if k not in os.environ]
for _k in _set:
    os.environ[_k] = MIMALLOC_OPTIONS[_k]
try:
    from yaml_rs import YAMLDecodeError, loads
finally:
    for _k in _set:
        del os.environ[_k]

__all__ = ["YAMLDecodeError", "loads"]
