"""The World: shared state between hosts, on a small key-value protocol (see kv.py)."""
