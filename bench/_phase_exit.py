"""`evergraph ARGS...` that ends its process at a point of a run's serial chain, for
bench/phases.py: EVERGRAPH_BENCH_EXIT_AT=parse (the YAML frontend's preload
begins), fork (the children ahead are about to be forked) or go (the engine lets
them make). The exit is os._exit(0): nothing after the point runs (the children
forked, if any, end with their parent)."""

import gc
import os
import sys

gc.disable()  # (as the console script does before its imports: cli/entry.py)

from evergraph.engine.ahead import Ahead  # noqa: E402
from evergraph.frontends.yaml import YamlFrontend  # noqa: E402

AT = os.environ.get("EVERGRAPH_BENCH_EXIT_AT", "")


def _end(*args: object, **kwargs: object) -> None:
    os._exit(0)


if AT == "parse":
    YamlFrontend.preload = _end
elif AT == "fork":
    Ahead.start = classmethod(_end)
elif AT == "go":
    Ahead.go = _end
elif AT:
    raise SystemExit(f"EVERGRAPH_BENCH_EXIT_AT={AT!r}: expected parse, fork or go")

if __name__ == "__main__":
    from evergraph.cli.entry import main

    sys.argv[0] = "evergraph"
    raise SystemExit(main())
