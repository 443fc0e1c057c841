"""The lean GGUF tensor reader gives what gguf's own reader gives: names, types, shapes and bytes, whatever the
metadata before them holds (string arrays as a tokenizer's, every value type, another alignment)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from speculative.engine.gguf_tensors import read_tensors


@pytest.mark.parametrize("alignment", [None, 64])
def test_the_tensors_are_gguf_readers_after_any_metadata(tmp_path: Path, alignment: int | None) -> None:
    path = tmp_path / "tiny.gguf"
    writer = GGUFWriter(str(path), "qwen2")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_string("general.name", "tiny ✓")  # multi-byte UTF-8 in the metadata
    writer.add_token_list([f"tok{i}" for i in range(300)] + ["\u00e9t\u00e9"])
    writer.add_array("tokenizer.ggml.token_type", [1] * 301)
    writer.add_array("some.floats", [0.5, 1.5])
    writer.add_array("some.nested", [[1, 2], ["a", "b"]])
    writer.add_bool("some.flag", True)
    writer.add_uint64("some.count", 2**40)
    writer.add_float64("some.ratio", 0.25)
    generator = np.random.default_rng(0)
    tensors = {
        "blk.0.attn_q.weight": (GGMLQuantizationType.Q4_K, generator.integers(0, 256, (8, 2 * 144), dtype=np.uint8)),
        "blk.0.ffn_down.weight": (GGMLQuantizationType.Q6_K, generator.integers(0, 256, (3, 210), dtype=np.uint8)),
        "blk.0.attn_v.weight": (GGMLQuantizationType.Q8_0, generator.integers(0, 256, (5, 2 * 34), dtype=np.uint8)),
    }
    for name, (kind, raw) in tensors.items():
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=kind)
    norm = generator.standard_normal(24).astype(np.float32)
    writer.add_tensor("blk.0.attn_norm.weight", norm)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    mine, theirs = read_tensors(path), GGUFReader(str(path)).tensors
    assert [t.name for t in mine] == [t.name for t in theirs] == [*tensors, "blk.0.attn_norm.weight"]
    for a, b in zip(mine, theirs, strict=True):
        assert a.tensor_type == b.tensor_type and a.shape == tuple(int(d) for d in b.shape)
        assert np.array_equal(a.data.reshape(-1), np.asarray(b.data).reshape(-1).view(np.uint8))
    for t in mine[:3]:
        assert np.array_equal(t.data, tensors[t.name][1])  # [rows, bytes a row], as written
    assert np.array_equal(mine[3].data.view(np.float32).reshape(-1), norm)


def test_a_file_that_is_not_gguf_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(b"PK\x03\x04" + bytes(60))
    with pytest.raises(ValueError, match=r"model\.bin: not a GGUF file"):
        read_tensors(path)
