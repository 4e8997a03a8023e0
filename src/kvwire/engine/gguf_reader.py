"""Opening a GGUF file with the maintained ``gguf`` package: its metadata and its tensors,
dequantized to float32.

Dequantization is ``gguf.quants.dequantize`` (the same routine ``transformers`` uses for GGUF
files). Only the types in :data:`SUPPORTED_TYPES` are accepted; any other is a ModelLoadError that
names the type and the tensor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvwire.errors import ModelLoadError

# Float and the legacy block quantizations (gguf can both quantize and dequantize these, which
# tests/unit/engine/test_gguf.py uses to check each one end to end).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    name: str  # the GGUF name, e.g. "blk.0.attn_q.weight"
    type_name: str  # e.g. "Q4_1"
    shape: tuple[int, ...]  # PyTorch order (rows first), e.g. (out_features, in_features)
    raw: Any  # the reader's view of the bytes / values (memory-mapped)

    def dequantize(self) -> np.ndarray:
        """The tensor as float32, shaped :attr:`shape`."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        if self.type_name not in SUPPORTED_TYPES:
            raise ModelLoadError(
                f"tensor {self.name!r} has type {self.type_name}, which kvwire does not dequantize "
                f"(supported: {', '.join(SUPPORTED_TYPES)})"
            )
        values = np.asarray(dequantize(self.raw, GGMLQuantizationType[self.type_name]), dtype=np.float32)
        if not values.flags.writeable:  # F32 comes back as a view of the read-only memory map
            values = values.copy()
        return values.reshape(self.shape)


class GGUFMetadata:
    """The key/value metadata of one file, read eagerly (:meth:`get`, :meth:`require`)."""

    def __init__(self, path: Path, fields: dict[str, Any]) -> None:
        self.path = path
        self._fields = fields

    def get(self, key: str, default: Any = None) -> Any:
        return self._fields.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self._fields:
            raise ModelLoadError(f"{self.path}: metadata key {key!r} is missing")
        return self._fields[key]


class GGUFFile:
    """An open GGUF file: ``metadata`` and ``tensors()``. The tensor data stay memory-mapped until
    each is dequantized."""

    def __init__(self, path: Path) -> None:
        try:
            from gguf import GGUFReader
        except ImportError as exc:
            raise ModelLoadError(
                "reading GGUF files needs the 'gguf' package: pip install 'gguf>=0.16'"
            ) from exc
        if not path.is_file():
            raise ModelLoadError(f"{path}: no such GGUF file")
        try:
            self._reader = GGUFReader(str(path))
            fields = {name: field.contents() for name, field in self._reader.fields.items()}
        except (ValueError, OSError, IndexError, KeyError) as exc:
            raise ModelLoadError(f"{path}: not a readable GGUF file ({exc})") from exc
        self.path = path
        self.metadata = GGUFMetadata(path, fields)

    def tensors(self) -> Iterator[GGUFTensor]:
        for t in self._reader.tensors:
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists the fastest dim first
            yield GGUFTensor(t.name, t.tensor_type.name, shape, t.data)
