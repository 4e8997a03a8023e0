"""Configuration enums given by value: ``"pull"`` for ``TransferMode.PULL`` (what CLIs and tests spell).

No torch; usable from every layer.
"""

from __future__ import annotations

import enum
from typing import TypeVar

from kvwire.errors import ConfigError

E = TypeVar("E", bound=enum.Enum)


def as_enum(cls: type[E], value: object, name: str) -> E:
    """``value`` as a member of ``cls``: the member itself, or its value. Raises
    :class:`~kvwire.errors.ConfigError` naming ``name`` and the valid values."""
    if isinstance(value, cls):
        return value
    try:
        return cls(value)
    except (ValueError, TypeError):
        choices = ", ".join(str(member.value) for member in cls)
        raise ConfigError(f"{name} must be one of {choices}; got {value!r}") from None
