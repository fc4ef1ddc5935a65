"""Kernel change notification shared by the engine, resources and frontends."""

from evergraph.watch.inotify import InotifyHub

__all__ = ["InotifyHub"]
