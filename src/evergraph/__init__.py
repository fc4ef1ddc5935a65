"""evergraph: event-driven, parallel configuration management.

`import evergraph` gives the engine the CLI uses (see docs/architecture.md).
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
