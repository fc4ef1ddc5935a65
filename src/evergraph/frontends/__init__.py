"""Graph producers: each turns user input into a stream of `GraphModel`s for the
engine (see `frontends.base` for the interface)."""
