"""ops.pack_gguf_panels + ops.panel_linear (csrc/linear/quant_*): a GGUF file's Q4_1 / Q8_0 /
Q4_K / Q6_K blocks kept packed and dequantized in registers. The weights must be exactly the fp32
values the loader's dequantization gives (gguf.quants), on every ISA variant; the products are
held to an fp64 reference and, where both kernels sum in the same order, to the fp32 panels bit
for bit.
The model then gives the same logits with and without the blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freetoken import ops

gguf = pytest.importorskip("gguf")

pytestmark = pytest.mark.skipif(not ops.panel_linear_available(torch.empty(1)),
                                reason="freetoken._C with panel_linear not built")

RTOL = 1e-5  # as tests/test_panel_linear.py: |y - ref| <= RTOL * (|x| @ |W|^T + |b|)
TYPES = ["Q4_1", "Q8_0", "Q4_K", "Q6_K"]
VALUES = {"Q4_1": 32, "Q8_0": 32, "Q4_K": 256, "Q6_K": 256}  # k a block holds


def k_for(type_: str, k: int) -> int:
    """The test's k for a 32-value type, scaled to a multiple of the type's block."""
    return k * VALUES[type_] // 32


@pytest.fixture(params=[1, 2])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def random_blocks(type_: str, n: int, k: int, seed: int = 0):
    """Random GGUF rows [n, k / block values * block bytes] -> (rows uint8 tensor, the loader's
    fp32 W). Scales cover fp16's range: normal, subnormal, zero and negative values (Q4_K: d and
    dmin, then random 6-bit scales and mins; Q6_K: d, then random int8 scales, -128 included)."""
    rng = np.random.default_rng(seed)
    nb = n * k // VALUES[type_]
    scales = rng.standard_normal((nb, 2)).astype(np.float32) * 0.05
    scales[rng.random((nb, 2)) < 0.05] = 3e-7  # fp16 subnormal
    scales[rng.random((nb, 2)) < 0.02] = 0.0
    scales[rng.random((nb, 2)) < 0.02] *= 4000.0
    half = scales.astype(np.float16).view(np.uint8).reshape(nb, 4)
    if type_ == "Q4_1":
        raw = np.concatenate([half, rng.integers(0, 256, (nb, 16), dtype=np.uint8)], axis=1)
    elif type_ == "Q4_K":  # d, dmin, 12 bytes of packed scales, 128 of nibbles
        raw = np.concatenate([half, rng.integers(0, 256, (nb, 140), dtype=np.uint8)], axis=1)
    elif type_ == "Q6_K":  # ql[128], qh[64], 16 int8 scales, d
        raw = np.concatenate([rng.integers(0, 256, (nb, 208), dtype=np.uint8), half[:, :2]],
                             axis=1)
    else:
        raw = np.concatenate([half[:, :2], rng.integers(0, 256, (nb, 32), dtype=np.uint8)],
                             axis=1)
    raw = raw.reshape(n, -1)
    w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_])
    return torch.from_numpy(np.ascontiguousarray(raw)), torch.from_numpy(
        np.asarray(w, dtype=np.float32).reshape(n, k).copy())


def weights_of(packed: torch.Tensor, k: int) -> torch.Tensor:
    """The fp32 W the kernel uses: x = I gives y = W^T exactly (one product per output)."""
    return ops.panel_linear(torch.eye(k), packed).T.contiguous()


@pytest.mark.parametrize("type_", TYPES)
@pytest.mark.parametrize("n,k", [(1, 32), (15, 64), (17, 96), (40, 576)])
def test_weights_are_the_loaders_bit_for_bit(isa, type_, n, k):
    k = k_for(type_, k)
    rows, w = random_blocks(type_, n, k, seed=n + k)
    packed = ops.pack_gguf_panels(rows, type_, k)
    assert ops.panel_shape(packed) == (n, k) and ops.gguf_panel_type(packed) == type_
    assert torch.equal(weights_of(packed, k), w)


def test_the_real_models_tensors_bit_for_bit(smollm2_path):
    reader = gguf.GGUFReader(str(smollm2_path))
    tensors = {t.name: t for t in reader.tensors}
    for name, rows_kept in (("blk.0.attn_q.weight", None), ("blk.29.ffn_down.weight", None),
                            ("token_embd.weight", 700)):
        t = tensors[name]
        k, n = (int(s) for s in t.shape)
        raw = np.asarray(t.data).reshape(n, -1)[:rows_kept]
        w = gguf.quants.dequantize(raw, t.tensor_type)
        packed = ops.pack_gguf_panels(torch.from_numpy(np.array(raw)), t.tensor_type.name, k)
        assert torch.equal(weights_of(packed, k), torch.from_numpy(np.asarray(w, np.float32)))


@pytest.mark.parametrize("type_", TYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 9, 16, 37, 64])
@pytest.mark.parametrize("n,k", [(17, 64), (200, 576), (1536, 576)])
def test_matches_an_fp64_reference(isa, threads, type_, m, n, k):
    k = k_for(type_, k)
    rows, w = random_blocks(type_, n, k, seed=3)
    g = torch.Generator().manual_seed(m * 31 + n)
    x, b = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    packed = ops.pack_gguf_panels(rows, type_, k)
    for bias in (None, b):
        y = ops.panel_linear(x, packed, bias)
        ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
        bound = x.double().abs() @ w.double().abs().T + (0 if bias is None else b.abs().double())
        assert y.dtype == torch.float32 and y.shape == (m, n)
        assert ((y.double() - ref).abs() <= RTOL * bound + 1e-30).all()


@pytest.mark.parametrize("type_", TYPES)
@pytest.mark.parametrize("n", [100, 1000])
def test_same_sums_as_the_fp32_panels(isa, threads, type_, n):
    k = 576 if VALUES[type_] == 32 else 2048  # Q4_K, Q6_K: the 1B file's hidden size
    rows, w = random_blocks(type_, n, k, seed=5)
    blocks, plain = ops.pack_gguf_panels(rows, type_, k), ops.pack_panels(w)
    # every row count, on every ISA, both paths of the GGUF panels (in registers up to 7 rows
    # on AVX2, 48 elsewhere, a block of panels decoded into fp32 past that; n = 1000: several
    # blocks a thread): the fp32 panels' bits, so a step's row count never changes a row's
    # result (issue 23)
    for m in [*range(1, 18), 31, 48, 49, 64, 231]:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        b = torch.randn(n, generator=torch.Generator().manual_seed(n))
        assert torch.equal(ops.panel_linear(x, blocks), ops.panel_linear(x, plain)), m
        assert torch.equal(ops.panel_linear(x, blocks, b), ops.panel_linear(x, plain, b)), m


@pytest.mark.parametrize("type_", TYPES)
def test_packing_from_a_file_map_unmaps_its_pages(tmp_path, type_):
    """release_rows: the rows are a view of a file's read-only map, unmapped as they are
    consumed (the loader's way: the repacked copy is then the one copy resident). The panels
    are those packed from a copy, and the map still reads right afterwards (the pages refault
    from the page cache)."""
    k = k_for(type_, 64)
    rows, _ = random_blocks(type_, 5000, k, seed=9)  # ~200-720 KB: several release steps
    path = tmp_path / "rows.bin"
    rows.numpy().tofile(path)
    view = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="r",
                                      shape=tuple(rows.shape)))
    packed = ops.pack_gguf_panels(view, type_, k, release_rows=True)
    assert torch.equal(packed, ops.pack_gguf_panels(rows, type_, k))
    assert torch.equal(view, rows)
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.pack_gguf_panels(view[::2], type_, k, release_rows=True)


def test_the_packed_form_survives_clone_and_save(tmp_path):
    rows, w = random_blocks("Q4_1", 33, 64)
    packed = ops.pack_gguf_panels(rows, "Q4_1", 64)
    torch.save(packed.clone(), tmp_path / "p.pt")
    again = torch.load(tmp_path / "p.pt")
    x = torch.randn(4, 64)
    assert torch.equal(ops.panel_linear(x, again), ops.panel_linear(x, packed))


def test_bad_inputs_are_refused():
    rows, _ = random_blocks("Q4_1", 16, 64)
    with pytest.raises(ValueError, match="type must be one of"):
        ops.pack_gguf_panels(rows, "Q5_K", 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        ops.pack_gguf_panels(rows, "Q4_1", 48)
    with pytest.raises(ValueError, match="multiple of 256 for Q4_K"):
        ops.pack_gguf_panels(rows, "Q4_K", 64)
    with pytest.raises(ValueError, match=r"\[N >= 1, 40\]"):
        ops.pack_gguf_panels(rows[:, :30], "Q4_1", 64)
    with pytest.raises(ValueError, match="uint8"):
        ops.pack_gguf_panels(rows.to(torch.int16), "Q4_1", 64)
    with pytest.raises(ValueError, match="must be a uint8"):  # Q8_0 rows are 68 bytes here
        ops.pack_gguf_panels(rows, "Q8_0", 64)
    packed = ops.pack_gguf_panels(rows, "Q4_1", 64)
    with pytest.raises(ValueError, match="weight's dtype"):
        ops.panel_linear(torch.randn(2, 64, dtype=torch.bfloat16), packed)
    with pytest.raises(ValueError, match="K = 32"):
        ops.panel_linear(torch.randn(2, 32), packed)
    broken = packed.clone()
    broken[24] = 7  # the format word
    with pytest.raises(ValueError, match="format"):
        ops.panel_linear(torch.randn(2, 64), broken)
    with pytest.raises(ValueError, match="size"):
        ops.panel_linear(torch.randn(2, 64), packed[:-384])


def test_smollm2_is_block_panels_with_the_fp32_panels_logits(smollm2_path, smollm2_fp32,
                                                              ops_config):
    """SmolLM2 fp32 (auto): every projection and the tied lm_head are its Q4_1 / Q8_0 blocks as
    panels (no fp32 copy; the embedding reads the file's rows); with
    ops.configure(linear="panels") every weight is dequantized into fp32 panels. Decode steps of
    1..8 sequences and prefill steps of 20-300 rows give the same logits bit for bit: both
    forms sum in one order (the block panels dequantize exactly)."""
    from freetoken.engine.generate import build_forward_batch
    from freetoken.loader import load_model
    from freetoken.model.linear import FEW_ROWS, packed_form
    from freetoken.model.llama import GGUFEmbedding

    blocks = smollm2_fp32.model
    assert ops.gguf_panel_type(blocks.layers[3].self_attn.qkv_proj.weight) == "Q4_1"
    assert ops.gguf_panel_type(blocks.layers[3].mlp.down_proj.weight) == "Q4_1"
    assert ops.gguf_panel_type(blocks.lm_head_packed) == "Q8_0"
    assert blocks.layers[3].mlp.down_proj.few_rows is None and blocks.lm_head_few_rows is None
    assert isinstance(blocks.embed_tokens, GGUFEmbedding)
    assert all(p.numel() < 1 << 20 for p in blocks.parameters()
               if p.dtype == torch.float32)  # norms only
    ops_config(linear="panels")
    plain = load_model(smollm2_path, load_tokenizer=False, progress=False).model
    assert packed_form(plain.layers[3].mlp.down_proj.weight) == "panels"
    prompt = list(range(100, 400))
    for n in (1, 3, FEW_ROWS):
        out = []
        for m in (blocks, plain):
            kv = m.make_kv_cache(64, 16)
            prefill = build_forward_batch([(prompt[:20 + 5 * s], 0, list(range(4 * s, 4 * s + 4)))
                                           for s in range(n)], 16, all_logits=True)
            logits = m.compute_logits(m.forward(prefill, kv))
            step = build_forward_batch([([prompt[20 + 5 * s]], 20 + 5 * s,
                                         list(range(4 * s, 4 * s + 4)))
                                        for s in range(n)], 16)
            out.append((logits, m.compute_logits(m.forward(step, kv))))
        assert torch.equal(out[0][0], out[1][0]), n  # 20, 75 and 300 rows
        assert torch.equal(out[0][1], out[1][1]), n


def test_the_kernel_ab_script_compares_two_trees():
    # scripts/ab_kernel.py (issue 23's measurements): this tree against itself, tiny, one case
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, str(root / "scripts" / "ab_kernel.py"), f"A={root}", f"B={root}",
         "--type", "Q4_1", "--n", "40", "--k", "64", "--rows", "3", "--copies", "2",
         "--cases", "1:hot", "--bursts", "2"], capture_output=True, text=True, timeout=300,
        check=True)
    first = [line for line in out.stderr.splitlines() if "y[0, :2]" in line]
    assert len(first) == 2 and first[0].split("=", 1)[1] == first[1].split("=", 1)[1]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["rows"] == 3 and set(report["cases"][0]["median_ms"]) == {"A", "B"}
    assert all(t > 0 for t in report["cases"][0]["median_ms"].values())
