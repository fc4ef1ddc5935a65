"""A message of the day rendered from the cluster's member list.

Run it on every host (each joins the World as a member):

    evergraph run examples/motd.py

and change the greeting from anywhere that reaches the same World:

    evergraph world put motd/greeting "Good morning"

`graph()` read the greeting and the member list, so a new greeting, a host
joining or a host leaving runs it again and rewrites the file within
milliseconds; nothing else is touched.
"""

import os

#: where the files go (tests point this at a temporary directory)
ROOT = os.environ.get("EVERGRAPH_EXAMPLE_ROOT", "/tmp/evergraph-motd")


def graph(g, world):
    greeting = world.get("motd/greeting", default="Welcome")
    hosts = sorted(m.host for m in world.members())
    lines = [f"{greeting} to {world.host}.", f"{len(hosts)} host(s) in this cluster:"]
    lines += [f"  - {h}" for h in hosts]
    g.add("file", "motd-dir", path=f"{ROOT}/", mode="0755")
    # an automatic edge puts the file after its directory
    g.add("file", "motd", path=f"{ROOT}/motd", content="\n".join(lines) + "\n", mode="0644")
