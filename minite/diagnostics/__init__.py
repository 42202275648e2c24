"""minite.diagnostics (see module docstrings)."""
