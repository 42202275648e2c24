"""minite.engines (see module docstrings)."""
