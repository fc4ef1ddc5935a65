"""Built-in resource kinds, one module per kind; importing this registers them all."""

from evergraph.resources import (  # noqa: F401  (register kinds)
    exec,
    file,
    gzip,
    hostname,
    http_client,
    kv,
    line,
    mount,
    net,
    noop,
    password,
    pkg,
    print,
    schedule,
    ssh_key,
    svc,
    sysctl,
    tar,
    timer,
    users,
)
