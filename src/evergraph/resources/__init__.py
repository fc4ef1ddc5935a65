"""Built-in resource kinds, one module per kind; importing this registers them all."""

from evergraph.resources import exec, file, noop, print, timer  # noqa: F401  (register kinds)
