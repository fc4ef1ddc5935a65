"""The agent: the process on each host, and the composition root that owns every
service it runs (World, host keys, inotify, membership, exports, frontend, engine)."""
