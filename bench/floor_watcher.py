"""Floor for drift latency: a minimal inotify watcher that repairs files when they change.

Run as a whole process: `python bench/floor_watcher.py SPEC.json STATUS_FILE
[--durable]`. It converges every file once (as bench/floor_files.py does),
watches each parent directory with one asyncinotify instance, appends `true`
to STATUS_FILE when ready, then on any event naming a managed file checks it
and rewrites it atomically if it differs (`--durable`: with the fsyncs of
evergraph's writes, inline, one after another). Stops on SIGTERM.
"""

import asyncio
import json
import sys

from asyncinotify import Inotify, Mask

from floor_files import converge

MASK = Mask.MODIFY | Mask.ATTRIB | Mask.CLOSE_WRITE | Mask.MOVED_FROM | Mask.MOVED_TO | Mask.DELETE


async def watch(spec: list[list[str]], status_file: str, durable: bool) -> None:
    by_dir: dict[str, dict[str, tuple[str, bytes, int, bool]]] = {}
    for path, content, mode in spec:
        d, _, name = path.rpartition("/")
        by_dir.setdefault(d, {})[name] = (path, content.encode(), int(mode, 8), durable)
        converge(path, content.encode(), int(mode, 8), durable)
    with Inotify() as ino:
        names = {}
        for d, files in by_dir.items():
            names[ino.add_watch(d, MASK)] = files
        with open(status_file, "a") as f:
            f.write("true\n")
        async for ev in ino:
            files = names.get(ev.watch)
            if files is None or ev.name is None:
                continue
            entry = files.get(str(ev.name))
            if entry is not None:
                converge(*entry)


def main() -> int:
    with open(sys.argv[1], "rb") as f:
        spec = json.load(f)
    asyncio.run(watch(spec, sys.argv[2], "--durable" in sys.argv[3:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
