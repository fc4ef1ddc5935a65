"""Leaf helpers shared by every layer; they import nothing else of evergraph."""
