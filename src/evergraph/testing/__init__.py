"""evergraph's test kit, shipped for users who write kinds, World backends or
graphs: a fake clock, a fake handle with a step harness for a kind, and the
contract checks every World backend must pass. Import from the submodules."""
