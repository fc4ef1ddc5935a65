"""Named crash points, for tests that prove "nothing lost" by killing the agent at an
exact instruction rather than at a random moment.

`EVERGRAPH_CRASH_AT=name` (or `name:N`, the N-th time the point is reached) makes
`crash_point(name)` SIGKILL this process there: no cleanup, no flush, exactly as a
kill -9 or a power cut would leave things. Unset (always, outside tests), a crash
point costs one comparison.
"""

from __future__ import annotations

import os
import signal

_SPEC = os.environ.get("EVERGRAPH_CRASH_AT") or None
_NAME, _, _NTH = (_SPEC or "").partition(":")
_left = int(_NTH) if _NTH.isdigit() else 1


def crash_point(name: str) -> None:
    global _left
    if _SPEC is None or name != _NAME:
        return
    _left -= 1
    if _left <= 0:
        os.kill(os.getpid(), signal.SIGKILL)
