"""The lazy GGUF reader gives what `gguf.GGUFReader` gives (every metadata value, every tensor's
type, shape, offset and data) on files written by `gguf.GGUFWriter`, and a clear error on
broken files."""

from __future__ import annotations

import struct

import gguf
from gguf.constants import GGMLQuantizationType as QT
import numpy as np
import pytest

from specmoe.loader.gguf_header import GGUFHeader
from tests.gguf_blocks import random_blocks


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("header") / "all_types.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -7)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 1e-5)
    w.add_uint64("t.u64", 1 << 60)
    w.add_int64("t.i64", -(1 << 60))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo")
    w.add_array("t.strings", ["a", "", "ünïcode", "x" * 300] * 50)
    w.add_array("t.ints", list(range(-5, 1000)))
    w.add_array("t.floats", [0.5, -1.25, 3.0])
    w.add_array("t.empty", [])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((4, 7)).astype(np.float16))
    w.add_tensor("i32", np.arange(6, dtype=np.int32).reshape(2, 3))
    for t in (QT.Q4_K, QT.Q8_0, QT.Q6_K):
        w.add_tensor(f"q.{t.name}", random_blocks(t, 3, 256, seed=int(t)), raw_dtype=t)
    w.add_tensor("experts", random_blocks(QT.Q4_0, 2 * 4, 64, seed=1).reshape(2, 4, -1),
                 raw_dtype=QT.Q4_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_every_field_and_tensor_matches_gguf_reader(written):
    ours, theirs = GGUFHeader(written), gguf.GGUFReader(written)
    stored = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.fields) == list(stored)  # the reader's GGUF.* entries are the preamble's
    for name, field in stored.items():
        mine = ours.get_field(name)
        assert mine.types == field.types, name
        assert mine.contents() == field.contents(), name
    assert ours.get_field("t.strings").count == 200
    assert ours.get_field("nope") is None
    assert len(ours.tensors) == len(theirs.tensors) == 7
    for mine, t in zip(ours.tensors, theirs.tensors):
        assert (mine.name, mine.tensor_type, mine.n_elements, mine.n_bytes, mine.data_offset) \
            == (t.name, t.tensor_type, t.n_elements, t.n_bytes, t.data_offset)
        assert mine.shape.tolist() == t.shape.tolist()
        assert mine.data.dtype == t.data.dtype and mine.data.shape == t.data.shape
        assert np.array_equal(mine.data, t.data), t.name
        assert not mine.data.flags.writeable


def _patched(path, tmp_path, offset: int, data: bytes, name: str) -> str:
    raw = bytearray(open(path, "rb").read())
    raw[offset:offset + len(data)] = data
    out = tmp_path / name
    out.write_bytes(bytes(raw))
    return str(out)


def test_broken_files_raise_one_clear_error(written, tmp_path):
    raw = open(written, "rb").read()
    cases = {
        "magic": (_patched(written, tmp_path, 0, b"GGML", "magic.gguf"), "not a GGUF file"),
        "version": (_patched(written, tmp_path, 4, struct.pack("<I", 1 << 24), "big.gguf"),
                    "version 16777216 is not supported"),
        "value type": (_patched(written, tmp_path, 24 + 8 + len("general.architecture"),
                                struct.pack("<I", 99), "type.gguf"), "unknown value type 99"),
    }
    header_end = raw.rindex(b"experts") + len(b"experts") + 4 + 3 * 8 + 12
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(raw[:header_end + 64])
    cases["data"] = (str(cut), "runs past the end of the file")
    short = tmp_path / "short.gguf"
    short.write_bytes(raw[:300])
    cases["header"] = (str(short), "truncated or corrupt GGUF header|past the end")
    for what, (path, message) in cases.items():
        with pytest.raises(ValueError, match=message):
            GGUFHeader(path)
