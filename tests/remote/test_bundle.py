"""The bundle a host gets on first contact, and the store that keeps it (issue 26).

No SSH here: each "host" is a temp directory and the host's half (REMOTE_SCRIPT)
runs as a real subprocess of this interpreter, exactly as it will over a channel.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import platform
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest

from evergraph.remote.bundle import (
    COMPRESS_LEVEL,
    REMOTE_SCRIPT,
    Bundle,
    BundleError,
    HashCache,
    Installed,
    Stdin,
    cache_path,
    install,
    plan,
    python_problem,
    running_python,
)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class HostFailed(Exception):
    """The host's half exited non-zero (its stderr is the message)."""


async def run_here(argv: Sequence[str], stdin: Stdin) -> bytes:
    """The `Run` of the tests: ``python3 argv`` as a local subprocess."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        *argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    if isinstance(stdin, bytes):
        out, err = await proc.communicate(stdin)
    else:
        assert proc.stdin is not None
        assert proc.stdout is not None
        assert proc.stderr is not None
        to_host = proc.stdin

        async def feed() -> None:
            async for chunk in stdin:
                to_host.write(chunk)
                await to_host.drain()
            to_host.close()

        _, out, err = await asyncio.gather(feed(), proc.stdout.read(), proc.stderr.read())
        await proc.wait()
    if proc.returncode != 0:
        raise HostFailed(err.decode().strip())
    return out


def host_op(
    op: str, store: Path, digest: str, stdin: bytes = b""
) -> subprocess.CompletedProcess[bytes]:
    """One call of the host's half, for the tests that talk to it directly."""
    return subprocess.run(
        [sys.executable, "-I", "-c", REMOTE_SCRIPT, op, str(store), digest],
        input=stdin,
        capture_output=True,
        check=False,
    )


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Bundle:
    # its own hash cache: the tests leave the user's ~/.cache alone
    return Bundle.of_running_python(cache=tmp_path_factory.mktemp("cache") / "hashes.json")


def small_bundle(root: Path, files: dict[str, bytes], executable: Sequence[str] = ()) -> Bundle:
    """A bundle of a few made-up files (the store's tests need no 60 MB)."""
    paths: dict[str, Path] = {}
    for rel, content in files.items():
        local = root / rel.replace("/", "__")
        local.write_bytes(content)
        local.chmod(0o755 if rel in executable else 0o644)
        paths[rel] = local
    return Bundle.of_paths((paths, [("demo", "1.0")]))


def test_the_running_bundle_holds_evergraph_and_its_dependencies(running: Bundle) -> None:
    paths = {f.path for f in running.manifest.files}
    assert "site/evergraph/__init__.py" in paths
    assert "site/evergraph/remote/bundle.py" in paths
    assert "site/msgspec/__init__.py" in paths
    assert any(p.startswith("site/msgspec-") and p.endswith(".dist-info/METADATA") for p in paths)
    dists = dict(running.manifest.dists)
    assert {"evergraph", "msgspec", "click", "pynacl", "cffi"} <= set(dists)  # cffi: pynacl's
    assert "pytest" not in dists  # a dev extra, never shipped
    assert (
        running.manifest.python
        == running_python()
        == f"{sys.version_info[0]}.{sys.version_info[1]}"
    )
    assert running.manifest.machine == platform.machine()
    for f in running.manifest.files:
        assert "__pycache__" not in f.path, f.path
        assert not f.path.endswith(".pyc"), f.path
        assert not f.path.endswith(("/RECORD", "/INSTALLER", "/direct_url.json")), f.path
        assert f.mode in (0o644, 0o755)
        assert len(f.sha256) == 64
        assert f.size >= 0
    assert [f.path for f in running.manifest.files] == sorted(paths)
    # the manifest is canonical JSON whose hash is the digest
    decoded = msgspec.json.decode(running.manifest_bytes, type=type(running.manifest))
    assert decoded == running.manifest
    assert running.dir_name == running.digest[:16]


def test_the_digest_is_stable_across_two_calls(running: Bundle, tmp_path: Path) -> None:
    again = Bundle.of_running_python(cache=tmp_path / "hashes.json")
    assert again.digest == running.digest
    assert again.manifest_bytes == running.manifest_bytes


def test_a_changed_file_changes_the_digest(tmp_path: Path) -> None:
    first = small_bundle(tmp_path, {"site/demo/__init__.py": b"x = 1\n"})
    same = small_bundle(tmp_path, {"site/demo/__init__.py": b"x = 1\n"})
    changed = small_bundle(tmp_path, {"site/demo/__init__.py": b"x = 2\n"})
    assert first.digest == same.digest
    assert changed.digest != first.digest
    chmodded = small_bundle(
        tmp_path, {"site/demo/__init__.py": b"x = 1\n"}, executable=["site/demo/__init__.py"]
    )
    assert chmodded.digest != first.digest


def test_first_contact_installs_an_importable_bundle_and_the_second_sends_only_hashes(
    running: Bundle, tmp_path: Path
) -> None:
    host_a, host_b = tmp_path / "host-a", tmp_path / "host-b"

    started = time.monotonic()
    first = asyncio.run(install(running, run_here, store=str(host_a), host="host-a"))
    took = time.monotonic() - started
    print(
        f"\nfirst contact: {first.sent:,} bytes sent ({first.objects} objects, "
        f"{running.size:,} bytes of content) in {took:.2f} s"
    )
    assert first.objects == len(running.sources)
    assert first.site == f"{host_a}/bundles/{running.dir_name}/site"
    site = Path(first.site)
    assert (site.parent / "manifest.json").read_bytes() == running.manifest_bytes
    assert not list((host_a / "bundles").glob("*.tmp*"))  # built beside, renamed into place

    # without the initiator's site-packages (-S): everything comes from the bundle
    probe = (
        "import evergraph, msgspec, nacl, click, evergraph.cli.main, evergraph.remote.bundle;"
        "print(evergraph.__file__); print(msgspec.__file__); print(nacl.__file__)"
    )
    isolated_env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(site)}
    out = subprocess.run(
        [sys.executable, "-S", "-s", "-c", probe],
        env=isolated_env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert all(p.startswith(str(site) + "/") for p in out), out
    version = subprocess.run(
        [
            sys.executable,
            "-S",
            "-s",
            "-c",
            "import importlib.metadata as m; print(m.version('evergraph'))",
        ],
        env=isolated_env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert version == dict(running.manifest.dists)["evergraph"]
    # -I ignores PYTHONPATH: the launcher puts the site first itself
    out = subprocess.run(
        [
            sys.executable,
            "-I",
            "-S",
            "-c",
            f"import sys; sys.path.insert(0, {str(site)!r}); {probe}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert all(p.startswith(str(site) + "/") for p in out), out

    # a later run with the same version: the host has it, only the digest travels
    second = asyncio.run(install(running, run_here, store=str(host_a), host="host-a"))
    print(f"second run: {second.sent:,} bytes sent ({100 * second.sent / first.sent:.3f} %)")
    assert second.objects == 0
    assert second.site == first.site
    assert second.sent <= first.sent / 100

    # even the longer way (manifest sent, nothing missing) stays under 1 %
    missing = host_op("missing", host_a, running.digest, running.manifest_bytes)
    assert missing.returncode == 0
    assert missing.stdout == b""
    longer = len(running.manifest_bytes) + len(plan(running, []))
    print(f"manifest + empty plan: {longer:,} bytes ({100 * longer / first.sent:.3f} %)")
    assert longer <= first.sent / 100

    # another host starts from nothing
    other = asyncio.run(install(running, run_here, store=str(host_b), host="host-b"))
    assert other.objects == first.objects
    assert other.sent == first.sent


def test_the_plan_is_gzip_and_the_numbers_behind_it(running: Bundle) -> None:
    """The numbers behind `plan` compressing (printed with -s; no timing asserts)."""
    from evergraph.remote.bundle import _tar

    started = time.monotonic()
    plain = _tar(running, running.sources, compress=False)
    plain_s = time.monotonic() - started
    started = time.monotonic()
    gz = plan(running, running.sources)
    gz_s = time.monotonic() - started
    print(
        f"\nfirst-run plan: tar {len(plain):,} bytes in {plain_s:.2f} s; "
        f"gzip -{COMPRESS_LEVEL} {len(gz):,} bytes in {gz_s:.2f} s"
    )
    assert gz[:2] == b"\x1f\x8b"  # what the host's stdlib reads with "r|gz"
    assert len(gz) < len(plain)
    with tarfile.open(fileobj=io.BytesIO(gz), mode="r|gz") as tar:
        assert sorted(m.name for m in tar) == sorted(running.sources)


def test_hosts_missing_the_same_objects_share_one_plan_built_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import evergraph.remote.bundle as bundle_mod

    (tmp_path / "src").mkdir()
    bundle = small_bundle(tmp_path / "src", {"site/demo/a.py": b"a\n", "site/demo/b.py": b"b\n"})
    built: list[tuple[str, ...]] = []
    real_build = bundle_mod.SharedPlan.build

    def counting_build(self: bundle_mod.SharedPlan, b: Bundle, key: tuple[str, ...]) -> None:
        built.append(key)
        real_build(self, b, key)

    monkeypatch.setattr(bundle_mod.SharedPlan, "build", counting_build)
    hosts = [tmp_path / f"host-{i}" for i in range(4)]

    async def first_contact() -> list[Installed]:
        return await asyncio.gather(
            *(install(bundle, run_here, store=str(h), host=h.name) for h in hosts)
        )

    done = asyncio.run(first_contact())
    assert built == [tuple(sorted(bundle.sources))]  # once, for the four hosts
    assert all(d.objects == 2 for d in done)
    assert len({d.sent for d in done}) == 1
    for h in hosts:
        assert (h / "bundles" / bundle.dir_name / "site/demo/b.py").read_bytes() == b"b\n"
    # a host missing another set gets a plan of its own; the same set again is not rebuilt
    sha_a = next(f.sha256 for f in bundle.manifest.files if f.path.endswith("a.py"))

    async def twice() -> tuple[bytes, bytes, bytes]:
        return (
            await bundle.plan_for([sha_a]).read(),
            await bundle.plan_for([sha_a, sha_a]).read(),
            await bundle.plan_for(bundle.sources).read(),
        )

    one, same, everything = asyncio.run(twice())
    assert one == same == plan(bundle, [sha_a])
    assert everything == plan(bundle, bundle.sources)
    assert built == [tuple(sorted(bundle.sources)), (sha_a,)]
    assert bundle.plan_for([sha_a]) is bundle.plan_for([sha_a])
    # an object the bundle does not hold: refused before anything is built
    with pytest.raises(BundleError, match="not in this bundle"):
        bundle.plan_for(["f" * 64])
    assert len(built) == 2


def test_a_plan_read_while_it_is_built_is_the_whole_plan(tmp_path: Path) -> None:
    """Hosts read the plan as it grows (PLAN_CHUNK at a time), from their own start."""
    import evergraph.remote.bundle as bundle_mod

    (tmp_path / "src").mkdir()
    files = {f"site/demo/m{i}.py": os.urandom(100_000) for i in range(8)}  # incompressible
    bundle = small_bundle(tmp_path / "src", files)
    whole = plan(bundle, bundle.sources)
    assert len(whole) > 2 * bundle_mod.PLAN_CHUNK  # more than one piece

    async def readers() -> list[bytes]:
        shared = bundle.plan_for(bundle.sources)
        first = asyncio.create_task(shared.read())  # most likely while it is built
        return [await first, await shared.read()]  # and one after

    assert asyncio.run(readers()) == [whole, whole]
    with tarfile.open(fileobj=io.BytesIO(whole), mode="r|gz") as tar:
        assert sorted(m.name for m in tar) == sorted(bundle.sources)


# --- the initiator's cache of file hashes --------------------------------------------

LATER = 3600 * 10**9  # an hour: a clock past RACY_NS for files written just now


def test_the_hash_cache_spares_rehashing_and_sees_an_in_place_change(tmp_path: Path) -> None:
    cache = tmp_path / "cache" / "bundle-hashes.json"
    f = tmp_path / "mod.py"
    f.write_bytes(b"x = 1\n")

    first = HashCache.load(cache)
    first.now_ns = lambda: time.time_ns() + LATER
    sha1, size, mode = first.hash(f)
    first.save()
    assert (sha1, size, mode) == (sha256_hex(b"x = 1\n"), 6, 0o644)
    assert first.hashed == 1
    assert cache.stat().st_mode & 0o777 == 0o600
    assert cache.parent.stat().st_mode & 0o777 == 0o700

    again = HashCache.load(cache)
    assert again.hash(f) == (sha1, 6, 0o644)
    assert again.hashed == 0  # its stat is unchanged: the kept hash

    # the content changes in place, same size, its mtime put back: ctime moved
    # (a write or utime sets it to now, and nothing can set it back)
    before = os.stat(f)
    with f.open("r+b") as w:
        w.write(b"x = 2\n")
    os.utime(f, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(f)
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (
        before.st_size,
        before.st_mtime_ns,
        before.st_ino,
    )
    changed = HashCache.load(cache)
    assert changed.hash(f)[0] == sha256_hex(b"x = 2\n")
    assert changed.hashed == 1

    # so does a chmod (the mode that travels is taken from the same stat)
    f.chmod(0o755)
    assert HashCache.load(cache).hash(f) == (sha256_hex(b"x = 2\n"), 6, 0o755)


def test_a_file_changed_within_the_racy_window_is_never_kept(tmp_path: Path) -> None:
    """A write in the same clock tick as the stat leaves every stat field as it
    was: a hash taken of a file changed less than RACY_NS ago is used, not kept."""
    cache = tmp_path / "bundle-hashes.json"
    f = tmp_path / "mod.py"
    f.write_bytes(b"x = 1\n")
    fresh = HashCache.load(cache)  # the real clock: f was written just now
    assert fresh.hash(f)[0] == sha256_hex(b"x = 1\n")
    fresh.save()
    assert not cache.exists()  # nothing worth keeping
    # so an in-place change within the same tick (stat identical) is still seen
    st = os.stat(f)
    with f.open("r+b") as w:
        w.write(b"x = 3\n")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert HashCache.load(cache).hash(f)[0] == sha256_hex(b"x = 3\n")


def test_a_hash_cache_not_ours_or_of_another_version_is_ignored(tmp_path: Path) -> None:
    cache = tmp_path / "bundle-hashes.json"
    f = tmp_path / "mod.py"
    f.write_bytes(b"x = 1\n")
    hc = HashCache.load(cache)
    hc.now_ns = lambda: time.time_ns() + LATER
    hc.hash(f)
    hc.save()
    assert HashCache.load(cache).old  # kept

    cache.chmod(0o666)  # writable by others: anyone could have put a lie there
    assert not HashCache.load(cache).old
    cache.chmod(0o600)
    entry = msgspec.json.decode(cache.read_bytes())
    entry["key"] = "0.0.1 " + entry["key"]  # another evergraph's
    cache.write_bytes(msgspec.json.encode(entry))
    assert not HashCache.load(cache).old
    cache.write_bytes(b"{not json")
    assert not HashCache.load(cache).old
    # and a cache that cannot be written costs nothing but the hashing
    blocked = HashCache(tmp_path / "mod.py" / "no" / "cache.json")
    blocked.now_ns = lambda: time.time_ns() + LATER
    blocked.hash(f)
    blocked.save()


def test_a_cached_bundle_is_the_same_bundle(
    tmp_path: Path, running: Bundle, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_path() == tmp_path / "xdg" / "evergraph" / "bundle-hashes.json"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    assert cache_path() == Path.home() / ".cache" / "evergraph" / "bundle-hashes.json"
    cache = tmp_path / "cache.json"
    cold = Bundle.of_running_python(cache=cache)
    warm = Bundle.of_running_python(cache=cache)
    assert cold.manifest_bytes == warm.manifest_bytes == running.manifest_bytes
    assert cache.is_file()


def test_the_store_links_objects_and_copies_executables(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    shared = b"same bytes in two places\n"
    bundle = small_bundle(
        tmp_path / "src",
        {"site/demo/a.py": shared, "site/demo/b.py": shared, "site/demo/tool": b"#!/bin/sh\n"},
        executable=["site/demo/tool"],
    )
    store = tmp_path / "host"
    missing = host_op("missing", store, bundle.digest, bundle.manifest_bytes)
    assert missing.returncode == 0, missing.stderr
    assert len(missing.stdout.split()) == 2  # the shared content is one object
    stored = host_op("store", store, bundle.digest, plan(bundle, missing.stdout.decode().split()))
    assert stored.returncode == 0, stored.stderr
    site = store / "bundles" / bundle.dir_name / "site"
    assert (site / "demo/a.py").read_bytes() == shared
    assert (site / "demo/a.py").stat().st_ino == (site / "demo/b.py").stat().st_ino
    assert (site / "demo/a.py").stat().st_nlink == 3  # the object and its two names
    assert (site / "demo/tool").stat().st_mode & 0o777 == 0o755
    assert (site / "demo/tool").stat().st_nlink == 1  # a copy: its mode is its own
    sha = bundle.manifest.files[0].sha256
    assert (store / "objects" / sha[:2] / sha).is_file()


def test_a_tampered_object_is_refused(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    bundle = small_bundle(tmp_path / "src", {"site/demo/__init__.py": b"x = 1\n"})
    store = tmp_path / "host"
    assert host_op("missing", store, bundle.digest, bundle.manifest_bytes).returncode == 0
    sha = bundle.manifest.files[0].sha256
    forged = io.BytesIO()
    with tarfile.open(fileobj=forged, mode="w") as tar:
        info = tarfile.TarInfo(sha)
        info.size = len(b"x = 666\n")
        tar.addfile(info, io.BytesIO(b"x = 666\n"))
    refused = host_op("store", store, bundle.digest, forged.getvalue())
    assert refused.returncode == 3
    assert f"object {sha}: its content hashes to" in refused.stderr.decode()
    assert not (store / "objects" / sha[:2] / sha).exists()
    assert not list((store / "objects" / sha[:2]).iterdir())  # no temp left behind
    assert not (store / "bundles").exists()


def test_a_tar_member_that_is_not_an_object_is_refused(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    bundle = small_bundle(tmp_path / "src", {"site/demo/__init__.py": b"x = 1\n"})
    store = tmp_path / "host"
    assert host_op("missing", store, bundle.digest, bundle.manifest_bytes).returncode == 0
    evil = io.BytesIO()
    with tarfile.open(fileobj=evil, mode="w") as tar:
        info = tarfile.TarInfo("../../escaped")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"!"))
    refused = host_op("store", store, bundle.digest, evil.getvalue())
    assert refused.returncode == 3
    assert "refused tar member" in refused.stderr.decode()
    assert not (tmp_path / "escaped").exists()


def test_a_manifest_whose_hash_is_not_the_digest_is_refused(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    bundle = small_bundle(tmp_path / "src", {"site/demo/__init__.py": b"x = 1\n"})
    store = tmp_path / "host"
    other = "0" * 64
    refused = host_op("missing", store, other, bundle.manifest_bytes)
    assert refused.returncode == 3
    assert "refused" in refused.stderr.decode()
    assert not (store / "manifests" / f"{other}.json").exists()


def test_a_manifest_path_outside_site_is_refused(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    bundle = small_bundle(tmp_path / "src", {"site/../../outside": b"x\n"})
    store = tmp_path / "host"
    missing = host_op("missing", store, bundle.digest, bundle.manifest_bytes)
    refused = host_op("store", store, bundle.digest, plan(bundle, missing.stdout.decode().split()))
    assert refused.returncode == 3
    assert "refused path 'site/../../outside'" in refused.stderr.decode()
    assert not (tmp_path / "outside").exists()
    assert not (store / "bundles" / bundle.dir_name).exists()


def test_python_problem_names_both_sides_and_what_to_do() -> None:
    here, machine = running_python(), platform.machine()
    assert python_problem(here, machine) is None
    line = python_problem("3.9", machine, host="web1")
    assert line is not None
    assert "\n" not in line
    assert "web1 has python 3.9" in line
    assert f"needs python{here} on {machine}" in line
    assert line.endswith(f"install python{here} on web1")
    other = python_problem(here, "riscv64", host="web2")
    assert other is not None
    assert "riscv64" in other
    assert machine in other


def test_install_stops_at_a_host_with_another_python(running: Bundle) -> None:
    calls: list[str] = []

    async def old_host(argv: Sequence[str], stdin: bytes) -> bytes:
        calls.append(argv[3])
        return b'{"python": "3.9", "machine": "%s", "present": false}' % platform.machine().encode()

    with pytest.raises(BundleError, match=r"web1 has python 3\.9 .*: install python3\.\d+ on web1"):
        asyncio.run(install(running, old_host, store="/nowhere", host="web1"))
    assert calls == ["probe"]  # nothing else was sent


def test_a_finished_plan_is_kept_and_sent_again_without_compressing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import evergraph.remote.bundle as bundle_mod

    (tmp_path / "src").mkdir()
    files = {"site/demo/a.py": b"a\n", "site/demo/b.py": b"b\n"}
    cache = tmp_path / "cache" / "hashes.json"
    paths = {rel: tmp_path / "src" / rel.replace("/", "__") for rel in files}
    for rel, local in paths.items():
        local.write_bytes(files[rel])
    dists = [("demo", "1.0")]
    first = Bundle.of_paths((paths, dists), cache=cache)
    assert first.plan_cache == tmp_path / "cache" / "plans"
    built: list[tuple[str, ...]] = []
    real = bundle_mod._write_tar

    def counting(b: Bundle, missing: Iterable[str], emit: Any, *, compress: bool) -> None:
        built.append(tuple(missing))
        real(b, missing, emit, compress=compress)

    monkeypatch.setattr(bundle_mod, "_write_tar", counting)
    whole = asyncio.run(first.plan_for(first.sources).read())
    assert len(built) == 1
    kept = list((tmp_path / "cache" / "plans").glob("*.tar.gz"))
    assert len(kept) == 1
    assert kept[0].stat().st_mode & 0o777 == 0o600
    assert kept[0].read_bytes() == whole

    # the next run (a new Bundle of the same files): the kept plan, not a new one
    again = Bundle.of_paths((paths, dists), cache=cache)
    assert asyncio.run(again.plan_for(again.sources).read()) == whole
    assert len(built) == 1

    # a damaged plan is not sent: it is built anew (and kept again)
    kept[0].write_bytes(whole[:10] + bytes([whole[10] ^ 1]) + whole[11:])
    damaged = Bundle.of_paths((paths, dists), cache=cache)
    assert asyncio.run(damaged.plan_for(damaged.sources).read()) == whole
    assert len(built) == 2
    assert kept[0].read_bytes() == whole
    # and one that others could have written is not trusted either
    kept[0].chmod(0o666)
    loose = Bundle.of_paths((paths, dists), cache=cache)
    assert asyncio.run(loose.plan_for(loose.sources).read()) == whole
    assert len(built) == 3
