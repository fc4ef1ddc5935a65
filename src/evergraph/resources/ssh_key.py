"""ssh_key resource kinds (being written)."""
