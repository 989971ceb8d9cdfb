"""loader/gguf_file.py against the gguf package's GGUFReader, the reference: the same metadata
(values and value types), alignment, data offset and tensors (names, types, shapes, offsets,
sizes, data) on the SmolLM2 file, on the tiny Llama and Qwen2 the format tests load, and on files
written with every value type, both byte orders and a custom alignment; and the point of the
module: parsing SmolLM2 allocates a few MiB, not GGUFReader's ~165 MiB of per-token objects;
and loading SmolLM2 imports no torch._dynamo."""

from __future__ import annotations

import os
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFEndian, GGUFReader, GGUFValueType, GGUFWriter

from freetoken.loader.gguf_file import GGUFFile, StringArray
from freetoken.testing.gguf_files import write


def _ours_value(value):
    return value.tolist() if isinstance(value, StringArray | np.ndarray) else value


def assert_same_as_gguf(path) -> GGUFFile:
    ours, ref = GGUFFile(path), GGUFReader(str(path))
    ref_fields = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.fields) == list(ref_fields)  # the file's order
    for key, field in ref_fields.items():
        want, got = field.contents(), _ours_value(ours.fields[key])
        assert got == want and type(got) is type(want), key
        if isinstance(got, list):
            assert all(type(a) is type(b) for a, b in zip(got, want)), key
        assert ours.types[key] == tuple(field.types), key
    assert ours.version == int(ref.fields["GGUF.version"].contents())
    assert (ours.alignment, ours.data_offset) == (ref.alignment, ref.data_offset)
    assert len(ours.tensors) == len(ref.tensors)
    for a, b in zip(ours.tensors, ref.tensors):
        assert (a.name, a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == (
            b.name, b.tensor_type, b.n_elements, b.n_bytes, b.data_offset)
        assert a.shape.dtype == np.uint64 and a.shape.tolist() == b.shape.tolist()
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data, equal_nan=True), a.name
    return ours


def test_smollm2_as_gguf_reads_it(smollm2_path):
    ours = assert_same_as_gguf(smollm2_path)
    tokens = ours.fields["tokenizer.ggml.tokens"]
    assert isinstance(tokens, StringArray) and len(tokens) == 49152
    assert tokens[0] == "<|endoftext|>" and tokens[-1] == tokens.tolist()[-1]
    assert tokens[1:3] == tokens.tolist()[1:3]
    assert ours.path == os.path.abspath(smollm2_path)


@pytest.mark.parametrize("shape", ["tiny", "tiny-qwen2"])
@pytest.mark.parametrize("fmt", ["F32", "F16", "BF16", "Q4_1", "q4_k_m"])
def test_the_tiny_models_as_gguf_reads_them(tmp_path, shape, fmt):
    path = tmp_path / f"{shape}.{fmt}.gguf"
    write(str(path), shape, fmt)
    assert_same_as_gguf(path)


def _every_value_type(path, endianess=GGUFEndian.LITTLE, alignment=None):
    w = GGUFWriter(str(path), "llama", endianess=endianess)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    scalars = {
        GGUFValueType.UINT8: 200, GGUFValueType.INT8: -100, GGUFValueType.UINT16: 60000,
        GGUFValueType.INT16: -30000, GGUFValueType.UINT32: 4_000_000_000,
        GGUFValueType.INT32: -2_000_000_000, GGUFValueType.FLOAT32: 0.1,
        GGUFValueType.UINT64: 2**63 + 5, GGUFValueType.INT64: -(2**62),
        GGUFValueType.FLOAT64: 1e300, GGUFValueType.BOOL: True,
    }
    for kind, value in scalars.items():
        w.add_key_value(f"test.scalar.{kind.name}", value, kind)
        w.add_key_value(f"test.array.{kind.name}", [value, value], GGUFValueType.ARRAY,
                        sub_type=kind)
    w.add_key_value("test.string", "héllo ☃", GGUFValueType.STRING)
    w.add_key_value("test.strings", ["", "a", "世界", "\n"], GGUFValueType.ARRAY,
                    sub_type=GGUFValueType.STRING)
    w.add_key_value("test.nested", [[1, 2], [3]], GGUFValueType.ARRAY)
    rng = np.random.default_rng(0)
    w.add_tensor("a.weight", rng.standard_normal((3, 32)).astype(np.float32))
    w.add_tensor("b.weight", rng.standard_normal((5,)).astype(np.float16))
    w.add_tensor("c.weight", rng.integers(0, 256, (2, 68), dtype=np.uint8),
                 raw_dtype=GGMLQuantizationType.Q8_0)  # 2 rows of 64 values
    w.add_tensor("d.weight", np.arange(7, dtype=np.int32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("endianess", [GGUFEndian.LITTLE, GGUFEndian.BIG], ids=["le", "be"])
@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_type_byte_order_and_alignment(tmp_path, endianess, alignment):
    path = _every_value_type(tmp_path / "values.gguf", endianess, alignment)
    ours = assert_same_as_gguf(path)
    assert ours.alignment == (alignment or 32)
    assert ours.fields["test.strings"].tolist() == ["", "a", "世界", "\n"]
    assert ours.fields["test.scalar.UINT64"] == 2**63 + 5
    assert ours.fields["test.array.INT16"].dtype == np.int16  # this machine's byte order
    a = next(t for t in ours.tensors if t.name == "a.weight")
    order = "<" if endianess == GGUFEndian.LITTLE else ">"
    assert a.data.dtype == np.dtype(np.float32).newbyteorder(order)


def test_not_a_gguf_is_refused(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF"):
        GGUFFile(path)
    path.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(64))
    with pytest.raises(ValueError, match="version 1"):
        GGUFFile(path)


@pytest.mark.parametrize("kind, value, message", [
    (GGUFValueType.UINT32, 48, "not a power of two"), (GGUFValueType.UINT64, 64, "not a UINT32")])
def test_a_bad_alignment_is_refused(tmp_path, kind, value, message):
    w = GGUFWriter(str(tmp_path / "x.gguf"), "llama")
    w.add_key_value("general.alignment", value, kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    with pytest.raises(ValueError, match=message):
        GGUFFile(tmp_path / "x.gguf")
    with pytest.raises(ValueError):  # the reference refuses it too
        GGUFReader(str(tmp_path / "x.gguf"))


def test_parsing_smollm2_allocates_a_few_mib(smollm2_path):
    """GGUFReader builds ~200k numpy views for SmolLM2's vocabulary and merges (~165 MiB); the
    strings here are two blobs and their offsets."""
    tracemalloc.start()
    try:
        GGUFFile(smollm2_path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20, peak


def test_loading_smollm2_imports_no_dynamo(smollm2_path):
    """Building the model on the meta device used to import torch._dynamo (the embedding's random
    init and the RoPE arithmetic ran as meta kernels): ~70 MiB resident for good and ~1 s. A fresh
    process, as the server loads."""
    code = ("import sys; from freetoken import ops; from freetoken.loader import load_model; "
            f"ops.configure(linear='gguf'); load_model({str(smollm2_path)!r}, progress=False); "
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
