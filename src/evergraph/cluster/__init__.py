"""The cluster floor: what hosts agree on through the World. Identity (host keys,
pins), members, leader election, the scheduler, exports and deploys. It sits on
the storage floor (`evergraph.world`: the KV protocol, its backends and `follow`)
and knows nothing of the engine, resources or frontends."""
