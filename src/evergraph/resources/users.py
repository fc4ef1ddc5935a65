"""users resource kinds (being written)."""
