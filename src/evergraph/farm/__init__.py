"""The worker farm: Boruta's request queue over the World (SPEC 4.6)."""
