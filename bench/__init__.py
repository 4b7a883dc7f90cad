"""aioready's benchmark suite: `python -m bench <name>|all` (see bench/__main__.py)."""
