"""`evergraph ARGS...` that ends its process at a point of a run's serial chain, for
bench/phases.py: EVERGRAPH_BENCH_EXIT_AT=early (the early parse helper was just
forked: frontends/early.py), parse (the YAML frontend's preload begins), fork
(the children ahead are about to be forked) or go (the engine lets them make).
The exit is os._exit(0): nothing after the point runs (the children ahead
forked, if any, end with their parent; the early helper ends its parse)."""

import gc
import os
import sys

gc.disable()  # (as the console script does before its imports: cli/entry.py)

from evergraph.engine.ahead import Ahead  # noqa: E402
from evergraph.frontends.yaml import YamlFrontend  # noqa: E402

AT = os.environ.get("EVERGRAPH_BENCH_EXIT_AT", "")


def _end(*args: object, **kwargs: object) -> None:
    os._exit(0)


if AT == "early":
    try:
        from evergraph.frontends import early
    except ImportError:  # (a tree from before the helper: the point is not there)
        raise SystemExit("EVERGRAPH_BENCH_EXIT_AT=early: this tree has no early helper") from None
    _start = early.start

    def _start_then_end(args: list[str]) -> None:
        _start(args)
        os._exit(0)

    early.start = _start_then_end
elif AT == "parse":
    YamlFrontend.preload = _end
elif AT == "fork":
    Ahead.start = classmethod(_end)
elif AT == "go":
    Ahead.go = _end
elif AT:
    raise SystemExit(f"EVERGRAPH_BENCH_EXIT_AT={AT!r}: expected early, parse, fork or go")

if __name__ == "__main__":
    from evergraph.cli.entry import main

    sys.argv[0] = "evergraph"
    raise SystemExit(main())
