"""The fake clock for tests of leases and timeouts."""

from __future__ import annotations

from evergraph.testing.clock import FakeClock


def fake_clock() -> FakeClock:
    """A new FakeClock (time stands still until `await clock.advance(seconds)`)."""
    return FakeClock()
