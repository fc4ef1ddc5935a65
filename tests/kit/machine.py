"""Tests that change what the whole machine shares (Debian packages and apt's lock,
/etc/passwd and /etc/group, the systemd user manager, users' crontabs) must not
run beside each other. `scripts/test` runs the suite on several xdist workers, and
two suites may run at once: a module marked `pytestmark = MACHINE_WIDE` runs each
of its tests holding one machine-wide lock (a file lock, so it holds across
workers and across runs)."""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator

import pytest

#: the lock every machine-wide test holds while it runs (fixtures included)
LOCK = os.path.join(tempfile.gettempdir(), "evergraph-tests-machine-wide.lock")

MACHINE_WIDE = pytest.mark.usefixtures("machine_wide")


@pytest.fixture
def machine_wide() -> Iterator[None]:
    with open(LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        yield


#: the lock a test holds while it runs a multi-host etcd cluster in namespaces: five
#: agents and five etcd members with fast raft timing take both cores in bursts, so
#: two such tests (or two suites' worth) at once starve each other and the timing of
#: everything else; one at a time per machine
CLUSTER_LOCK = os.path.join(tempfile.gettempdir(), "evergraph-tests-one-cluster.lock")

ONE_CLUSTER = pytest.mark.usefixtures("one_cluster")


@pytest.fixture
def one_cluster() -> Iterator[None]:
    with open(CLUSTER_LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield
