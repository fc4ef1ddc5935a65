"""evergraph's benchmarks: `scripts/bench` (or `python -m bench`) runs them all.

Never run by the test suite. Each benchmark measures evergraph against a
floor (the least a plain-Python program must do for the same job) and cleans
up every directory and process it creates.
"""
