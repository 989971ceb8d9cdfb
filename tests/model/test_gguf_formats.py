"""Every GGUF weight format through the whole loader and model, computed in place in the file's
blocks (linear "gguf": what "auto" does for models over 1 GiB as fp32): a tiny Llama and a tiny
Qwen2 (q/k/v biases, no q/k row permutation) written in each type (random valid blocks,
SmolLM2's tokenizer; freetoken.testing.gguf_files) give the logits of transformers loading the
same file (which dequantizes through the gguf package), within 1e-4, at two prompt lengths; and
the same model dequantized at load ("panels") within 1e-5, for a prefill step and the decode
steps after it."""

from __future__ import annotations

import pytest
import torch

from freetoken.engine.generate import build_forward_batch
from freetoken.loader import load_model
from freetoken.testing.gguf_files import use_more_bits, write

FORMATS = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K",
           "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "q4_k_m"]
BLOCK_SIZE = 16
PROMPT = [1, 504, 3458, 314, 253, 1117, 30, 2, 9690, 198, 28, 4122, 17, 44, 911, 3066, 30]


def logits(loaded, ids: list[int], kv) -> torch.Tensor:
    """The last position's logits of `ids` computed in one step from an empty cache."""
    blocks = list(range(-(-len(ids) // BLOCK_SIZE)))
    batch = build_forward_batch([(ids, 0, blocks)], BLOCK_SIZE)
    return loaded.model.compute_logits(loaded.model.forward(batch, kv))[0]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", ["tiny", "tiny-qwen2"])
def test_logits_match_transformers(tmp_path, shape, fmt, ops_config):
    transformers = pytest.importorskip("transformers")
    path = tmp_path / f"{shape}.{fmt}.gguf"
    write(str(path), shape, fmt, seed=FORMATS.index(fmt))
    ops_config(linear="gguf")
    ours = load_model(path, progress=False, load_tokenizer=False)
    assert ours.config.arch == ("qwen2" if shape == "tiny-qwen2" else "llama")
    assert ours.config.qkv_bias == (shape == "tiny-qwen2")
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    kv = ours.model.make_kv_cache(4, BLOCK_SIZE)
    for n in (len(PROMPT) - 2, len(PROMPT)):  # two prompt lengths, across a block boundary
        got = logits(ours, PROMPT[:n], kv)
        with torch.no_grad():
            want = ref(torch.tensor([PROMPT[:n]])).logits[0, -1].float()
        diff = float((got - want).abs().max())
        assert diff < 1e-4, (shape, fmt, n, diff)


@pytest.mark.parametrize("shape, fmt", [("tiny", "Q4_K"), ("tiny", "q4_k_m"), ("tiny", "Q8_0"),
                                        ("tiny", "IQ4_XS"), ("tiny-qwen2", "q4_k_m")])
def test_in_place_equals_the_dequantized_model(tmp_path, shape, fmt, ops_config):
    """A prefill of 17 tokens and 4 decode steps, in place and dequantized at load: the same
    weights, fp32 both, only the summation order differs (1e-5)."""
    from freetoken import ops
    from freetoken.model.linear import packed_form

    path = tmp_path / f"{shape}.{fmt}.gguf"
    write(str(path), shape, fmt, seed=7)
    out = {}
    for mode in ("gguf", "panels"):
        ops_config(linear=mode)
        loaded = load_model(path, progress=False, load_tokenizer=False)
        qkv = loaded.model.layers[0].self_attn.qkv_proj.weight
        assert packed_form(qkv) == ("gguf" if mode == "gguf" else
                                    "panels" if ops.panel_linear_available(qkv) else "onednn")
        kv = loaded.model.make_kv_cache(4, BLOCK_SIZE)
        steps = [logits(loaded, PROMPT, kv)]
        for i in range(4):  # decode: one new token at a time on the cached prompt
            batch = build_forward_batch([([5 + i], len(PROMPT) + i, [0, 1])], BLOCK_SIZE)
            steps.append(loaded.model.compute_logits(loaded.model.forward(batch, kv))[0])
        out[mode] = torch.stack(steps)
    diff = float((out["gguf"] - out["panels"]).abs().max())
    assert diff < 1e-5, (shape, fmt, diff)


def test_a_large_files_k_quant_matrices_are_block_panels(tmp_path, ops_config, monkeypatch):
    """Over IN_PLACE_MIN_BYTES as fp32 (here: any size) "auto" gives a Q4_K_M file's matrices of
    Q4_K alone or Q6_K alone block panels, and keeps a q|k|v of mixed types in place: the
    block panels sum in the fp32 panels' order, so the logits stay those of the model
    dequantized at load within 1e-5, for a prefill and the decode steps after it."""
    import freetoken.model.linear as linear_module
    from freetoken import ops
    from freetoken.model.linear import packed_form

    path = tmp_path / "tiny.q4_k_m.gguf"
    write(str(path), "tiny", "q4_k_m", seed=7)
    out = {}
    for mode in ("auto", "panels"):
        ops_config(linear=mode)
        with monkeypatch.context() as m:
            m.setattr(linear_module, "IN_PLACE_MIN_BYTES", 0)
            loaded = load_model(path, progress=False, load_tokenizer=False)
        if mode == "auto" and ops.panel_linear_available(torch.empty(1)):
            forms = {}
            n_layers = len(loaded.model.layers)
            for module, names in loaded.model.projections():
                form = packed_form(module.weight)
                forms.setdefault(form, []).append(names[0])
                layer = int(names[0].split(".")[2])
                more_bits = use_more_bits(layer, n_layers)
                mixed = more_bits and names[0].endswith("q_proj.weight")  # Q4_K q, k; Q6_K v
                down6 = more_bits and names[0].endswith("down_proj.weight")
                assert form == ("gguf" if mixed else "block panels"), (names, form)
                if form == "block panels":
                    assert ops.gguf_panel_type(module.weight) == ("Q6_K" if down6 else "Q4_K")
            assert set(forms) == {"gguf", "block panels"}
        kv = loaded.model.make_kv_cache(4, BLOCK_SIZE)
        steps = [logits(loaded, PROMPT, kv)]
        for i in range(4):
            batch = build_forward_batch([([5 + i], len(PROMPT) + i, [0, 1])], BLOCK_SIZE)
            steps.append(loaded.model.compute_logits(loaded.model.forward(batch, kv))[0])
        out[mode] = torch.stack(steps)
    diff = float((out["auto"] - out["panels"]).abs().max())
    assert diff < 1e-5, diff
