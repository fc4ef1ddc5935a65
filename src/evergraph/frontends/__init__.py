"""Graph producers: each turns user input into `GraphModel`s for the engine."""

from evergraph.frontends.yaml import YamlFrontend, load_yaml

__all__ = ["YamlFrontend", "load_yaml"]
