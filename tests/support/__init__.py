"""Helpers shared by tests in different folders (``pythonpath = ["tests"]`` in pyproject.toml)."""
