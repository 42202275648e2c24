"""minite.rl (see module docstrings)."""
