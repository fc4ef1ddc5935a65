"""Pause the cyclic garbage collector while building or swapping a large graph.

Building 10k resources allocates hundreds of thousands of long-lived objects;
with the collector on, Python re-walks them all in repeated collections
(measured: PyYAML load of 10k resources 2x faster with gc disabled, and the
graph operations here noticeably steadier). Nothing built in these phases is
cyclic garbage, so deferring collection to the end loses nothing.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
