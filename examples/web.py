"""The web tier: collects the upstream entries app hosts export (app.py) and
renders one upstream block from them; a change reloads the web server.

    evergraph run examples/web.py --hostname web1

`world.collect` is a live query: when an app host appears, changes its port
or goes away, this graph runs again and the config follows within
milliseconds. The collected files themselves are written too (add=True, the
default), one per app host under upstreams.d/.
"""

import os

ROOT = os.environ.get("EVERGRAPH_EXAMPLE_ROOT", "/tmp/evergraph-web")


def graph(g, world):
    apps = world.collect(kind="file", where=lambda r: r.name.startswith("upstream-"))
    servers = "".join(f"    {r.params['content']}" for r in apps)
    body = f"upstream app {{\n{servers}}}\n" if apps else "# no app hosts yet\n"
    conf = g.add("file", "upstreams", path=f"{ROOT}/upstreams.conf", content=body)
    # stands in for `nginx -s reload`: runs only when the config changed
    reload = g.add(
        "exec",
        "reload-web",
        cmd="/bin/sh",
        args=["-c", f"echo reloaded >> {ROOT}/reloads"],
        refresh_only=True,
    )
    g.edge(conf, reload, notify=True)
