"""password resource kinds (being written)."""
