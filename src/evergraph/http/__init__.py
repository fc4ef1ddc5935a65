"""The HTTP API served by an agent started with `--http ADDR`: thin adapters over the
agent's engine snapshots (and, as it lands, the farm), on Starlette and uvicorn."""
