"""pkg resource kinds (being written)."""
