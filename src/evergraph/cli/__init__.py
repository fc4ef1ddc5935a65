"""The `evergraph` command line: a thin adapter over the library."""
