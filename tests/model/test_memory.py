"""freetoken.loader.memory: a model's resident bytes counted from its file's headers, and a
model that cannot fit refused at start with both figures (the weights and the KV pool)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from gguf import GGUFReader

from freetoken.loader.memory import GiB, check_fits, weight_bytes


def header_counts(path):
    tensors = GGUFReader(path).tensors
    params = sum(int(t.n_elements) for t in tensors)
    matrices = sum(int(t.n_elements) for t in tensors if len(t.shape) == 2)
    embed = next(int(t.n_elements) for t in tensors if t.name == "token_embd.weight")
    file_bytes = sum(int(t.n_bytes) for t in tensors)
    blocks = sum(int(t.n_bytes) for t in tensors
                 if len(t.shape) == 2 and t.tensor_type.name in ("Q4_1", "Q8_0"))
    return params, matrices, embed, file_bytes, blocks


def block_panels(path):
    """The bytes of SmolLM2's Q4_1 / Q8_0 matrices as block panels (ops.pack_gguf_panels, per
    16 outputs x 32 inputs: Q4_1 16 fp16 scales, 16 fp16 mins and 256 bytes of codes; Q8_0 16
    fp32 scales and 512 bytes of codes), and those matrices' bytes in the file."""
    panels = file = 0
    for t in GGUFReader(path).tensors:
        if len(t.shape) == 2:
            k, n = (int(s) for s in t.shape)
            block = {"Q4_1": 320, "Q8_0": 576}[t.tensor_type.name]
            panels += 64 + -(-n // 16) * (k // 32) * block
            file += int(t.n_bytes)
    return panels, file


def test_smollm2_weights_by_dtype_and_device(smollm2_path, ops_config):
    """fp32 on the CPU (auto: SmolLM2's matrices are all Q4_1 / Q8_0): the file's tensors with
    the matrices as block panels, and the tied embedding's blocks still mapped for its lookups
    beside the lm_head's panels; served in place (linear "gguf"): the file's tensor bytes;
    dequantized (linear "panels"): every parameter, the tied lm_head's packed copy; bf16: half
    the bytes, but a second copy of every matrix; on a GPU: the parameters only."""
    params, matrices, embed, file_bytes, blocks = header_counts(smollm2_path)
    panels, matrix_file_bytes = block_panels(smollm2_path)
    embed_bytes = embed // 32 * 34  # Q8_0
    auto = weight_bytes(smollm2_path, torch.float32, "cpu")
    assert auto.total == file_bytes - matrix_file_bytes + panels + embed_bytes
    assert "block panels" in auto.detail
    assert 100 * 2**20 < auto.total < 160 * 2**20
    assert weight_bytes(smollm2_path, torch.bfloat16, "cpu").total == \
        2 * params + 2 * embed + 2 * matrices
    assert weight_bytes(smollm2_path, torch.float32, "cuda").total == 4 * params
    ops_config(linear="gguf")
    in_place = weight_bytes(smollm2_path, torch.float32, "cpu")
    assert in_place.total == file_bytes and "memory-mapped" in in_place.detail
    assert 80 * 2**20 < file_bytes < 100 * 2**20
    ops_config(linear="panels")
    assert weight_bytes(smollm2_path, torch.float32, "cpu").total == 4 * params + 4 * embed
    assert 0.6 * GiB < 4 * params + 4 * embed < 0.8 * GiB


def test_a_model_that_cannot_fit_is_refused_with_both_figures(smollm2_path, ops_config):
    ops_config(linear="panels")  # dequantized: 0.6 GiB of weights
    with pytest.raises(MemoryError) as err:
        check_fits(smollm2_path, torch.float32, "cpu", kv_bytes=GiB // 2, available=GiB)
    msg = str(err.value)
    assert "0.6 GiB for its weights" in msg and "0.5 GiB for the KV pool" in msg
    assert "1.0 GiB available" in msg and "--kv-cache-memory" in msg
    check_fits(smollm2_path, torch.float32, "cpu", kv_bytes=GiB // 2, available=4 * GiB)
    check_fits(smollm2_path, torch.float32, "cuda", kv_bytes=GiB, available=1)  # not ours
    ops_config(linear="auto")  # block panels: 0.1 GiB
    with pytest.raises(MemoryError, match="0.1 GiB for its weights"):
        check_fits(smollm2_path, torch.float32, "cpu", kv_bytes=GiB, available=GiB)
    check_fits(smollm2_path, torch.float32, "cpu", kv_bytes=GiB // 2, available=GiB)


def test_the_cli_refuses_before_loading(smollm2_path):
    """A KV pool larger than the machine: exit 2 with the figures, no model load, no port."""
    p = subprocess.run([sys.executable, "-m", "freetoken", "--model", str(smollm2_path),
                        "--kv-cache-memory", "4096GiB", "--port", "0"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert "4096.0 GiB for the KV pool" in p.stderr and "available" in p.stderr
    assert "dequantising" not in p.stderr and "mapping" not in p.stderr  # refused before the load
