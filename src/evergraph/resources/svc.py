"""svc resource kinds (being written)."""
