"""The tensors of a GGUF file: their names, types, shapes and bytes, read without the metadata's values.

gguf's `GGUFReader` parses every metadata field into numpy views before it lists a tensor: a Qwen2.5 file's
tokenizer (~300,000 strings) costs it ~10 s of Python, most of a served target's load. A weight load needs only
where the tensors are, so this reads the layout itself (GGUF v2 and v3, little-endian): the header, the metadata
walked over (its values skipped, `general.alignment` aside), the tensor infos, then each tensor's bytes as a view of
the memory-mapped file, shaped as `GGUFReader` shapes a quantized tensor's: [rows, bytes a row] uint8.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9  # metadata value types
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # fixed-size value types: bytes


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: a row's inputs first, then the rows (ne[0], ne[1], ...)
    data: np.ndarray  # [rows, bytes a row] uint8, a view of the file


class _Cursor:
    """Reads little-endian values from `buf` at `at`, moving on."""

    def __init__(self, buf: memoryview) -> None:
        self.buf, self.at = buf, 0

    def take(self, fmt: str) -> int:
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.at)
        self.at += struct.calcsize(fmt)
        return int(value)

    def string(self) -> str:
        length = self.take("Q")
        self.at += length
        return bytes(self.buf[self.at - length : self.at]).decode("utf-8")

    def skip(self, kind: int) -> None:
        """Steps over one metadata value of type `kind`."""
        if kind == _STRING:
            length = self.take("Q")  # (read before `at` moves past it)
            self.at += length
        elif kind == _ARRAY:
            item, count = self.take("I"), self.take("Q")
            if item in _SIZES:
                self.at += _SIZES[item] * count
            elif item == _STRING:  # a tokenizer's tokens and merges: 300k strings, in a loop of their own
                self.at = _past_strings(self.buf, self.at, count)
            else:
                for _ in range(count):
                    self.skip(item)
        elif kind in _SIZES:
            self.at += _SIZES[kind]
        else:
            raise ValueError(f"metadata value type {kind} at byte {self.at} is not GGUF's")


_LENGTH = struct.Struct("<Q")


def _past_strings(buf: memoryview, at: int, count: int) -> int:
    """Where the `count` strings (each a u64 length, then its bytes) from byte `at` of `buf` end."""
    length = _LENGTH.unpack_from
    for _ in range(count):
        at += 8 + length(buf, at)[0]
    return at


def read_tensors(path: Path) -> list[GGUFTensor]:
    """The tensors of GGUF file `path`, in the file's order; ValueError for a file that is not GGUF v2 or v3."""
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    cursor = _Cursor(mapped.data)
    if bytes(mapped[:4]) != MAGIC:
        raise ValueError(f"{path.name}: not a GGUF file (its first bytes are {bytes(mapped[:4])!r})")
    cursor.at = 4
    version = cursor.take("I")
    if version not in (2, 3):
        raise ValueError(f"{path.name}: GGUF version {version}; this reader takes versions 2 and 3")
    count, fields = cursor.take("Q"), cursor.take("Q")
    alignment = DEFAULT_ALIGNMENT
    for _ in range(fields):
        key, kind = cursor.string(), cursor.take("I")
        if key == "general.alignment" and kind == 4:  # uint32
            alignment = cursor.take("I")
        else:
            cursor.skip(kind)
    infos = []
    for _ in range(count):
        name = cursor.string()
        dims = tuple(cursor.take("Q") for _ in range(cursor.take("I")))
        infos.append((name, GGMLQuantizationType(cursor.take("I")), dims, cursor.take("Q")))
    start = -(-cursor.at // alignment) * alignment
    tensors = []
    for name, kind, dims, offset in infos:
        block, block_bytes = GGML_QUANT_SIZES[kind]
        row_bytes = dims[0] // block * block_bytes
        rows = int(np.prod(dims[1:], dtype=np.int64))  # (1 for a vector)
        at = start + offset
        data = mapped[at : at + rows * row_bytes].reshape(rows, row_bytes)
        tensors.append(GGUFTensor(name, kind, dims, data))
    return tensors
