"""Shared pytest configuration. GPU tests are marked ``gpu`` and deselected by default (see pyproject)."""
