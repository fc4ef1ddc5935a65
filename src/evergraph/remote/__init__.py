"""Reaching hosts over SSH that run nothing of evergraph yet (issue 26)."""
