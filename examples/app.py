"""An application host: its own config, plus an upstream entry exported to
the web tier (see web.py).

    evergraph run examples/app.py --hostname app1
    evergraph world put app/app1/port 9000     # re-renders both tiers live

The upstream file is `hidden` (this host does not write it) and exported to
every host (`"*"`); hosts running web.py collect it. Its name carries the
host's name, so that two app hosts export two resources.
"""

import os

ROOT = os.environ.get("EVERGRAPH_EXAMPLE_ROOT", "/tmp/evergraph-web")


def graph(g, world):
    me = world.host
    port = world.get(f"app/{me}/port", default="8080")
    g.add("file", f"app-{me}", path=f"{ROOT}/app-{me}.conf", content=f"port={port}\n")
    g.add(
        "file",
        f"upstream-{me}",
        path=f"{ROOT}/upstreams.d/{me}.conf",
        content=f"server {me}:{port};\n",
        meta={"export": ["*"], "hidden": True},
    )
