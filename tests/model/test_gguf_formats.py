"""Every GGUF weight format through the whole loader and model: a tiny Llama written in each
type (random valid blocks, SmolLM2's tokenizer; freetoken.testing.gguf_files) gives the logits
of transformers loading the same file (which dequantizes through the gguf package), within 1e-4,
for a prefill and for the decode steps after it."""

from __future__ import annotations

import pytest
import torch

from freetoken.engine.generate import build_forward_batch
from freetoken.loader import load_model
from freetoken.testing.gguf_files import write

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
def test_logits_match_transformers(tmp_path, fmt):
    transformers = pytest.importorskip("transformers")
    path = tmp_path / f"tiny.{fmt}.gguf"
    write(str(path), "tiny", fmt, seed=FORMATS.index(fmt))
    ours = load_model(path, progress=False, load_tokenizer=False)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    kv = ours.model.make_kv_cache(4, BLOCK_SIZE)
    for n in (len(PROMPT) - 2, len(PROMPT)):  # two prompt lengths, across a block boundary
        got = logits(ours, PROMPT[:n], kv)
        with torch.no_grad():
            want = ref(torch.tensor([PROMPT[:n]])).logits[0, -1].float()
        diff = float((got - want).abs().max())
        assert diff < 1e-4, (fmt, n, diff)
