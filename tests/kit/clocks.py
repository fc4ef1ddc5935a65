"""The fake clock for tests of leases and timeouts: the test kit's
`evergraph.testing.clock.FakeClock` (written on the engine's branch). Until that
module is merged the tests that need it are skipped; once it is, import it
directly here and drop the skip."""

from __future__ import annotations

from typing import Any

import pytest


def fake_clock() -> Any:
    """A new FakeClock (time stands still until `await clock.advance(seconds)`)."""
    return pytest.importorskip("evergraph.testing.clock").FakeClock()
