"""Hugging Face checkpoint directory -> (ModelConfig, HF-named weights).

Reads config.json, model.safetensors or the shards named by model.safetensors.index.json, and
generation_config.json (EOS ids). Not here: tokenizer.json (freetoken/tokenizer/).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from freetoken.loader.progress import progress as show_progress
from freetoken.loader.progress import progress_done
from freetoken.model.config import ModelConfig

logger = logging.getLogger(__name__)

HF_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _rope(cfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either transformers 5 `rope_parameters` or the older
    `rope_theta` + `rope_scaling` keys."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    theta = params.pop("rope_theta", None) or scaling.pop("rope_theta", None)
    theta = float(theta or cfg.get("rope_theta") or 10000.0)
    merged = {**scaling, **params}
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type == "default":
        return theta, None
    return theta, merged


def read_config(model_dir: Path) -> ModelConfig:
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{model_dir} has no config.json")
    cfg = json.loads(config_path.read_text())
    archs = cfg.get("architectures") or []
    hf_arch = archs[0] if archs else None
    if hf_arch not in HF_ARCHS:
        raise ValueError(
            f"unsupported architecture {hf_arch!r} in {config_path}; FreeToken "
            f"supports {sorted(HF_ARCHS)}"
        )
    arch = HF_ARCHS[hf_arch]
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{hf_arch} with hidden_act {act!r} is not supported (only silu)")
    sliding_window = None
    if arch == "mistral":
        sliding_window = cfg.get("sliding_window")
    elif arch in ("qwen2", "qwen3"):
        layer_types = cfg.get("layer_types") or []
        if cfg.get("use_sliding_window") and any(t != "full_attention" for t in layer_types):
            raise ValueError(
                f"{hf_arch} with use_sliding_window=true (per-layer sliding "
                f"window attention) is not supported"
            )
    theta, scaling = _rope(cfg)
    attention_bias = bool(cfg.get("attention_bias", False))
    eos_ids = _as_id_list(cfg.get("eos_token_id"))
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        gen = json.loads(gen_path.read_text())
        if gen.get("eos_token_id") is not None:
            eos_ids = _as_id_list(gen["eos_token_id"])
    return ModelConfig(
        arch=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=int(cfg["num_attention_heads"]),
        num_kv_heads=int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
        head_dim=int(cfg.get("head_dim") or 0),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=True if arch == "qwen2" else attention_bias,
        o_bias=False if arch == "qwen2" else attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=arch == "qwen3",
        sliding_window=sliding_window,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise ValueError(f"{model_dir} has neither model.safetensors nor model.safetensors.index.json")


def load_safetensors(
    model_dir: str | Path, progress: bool = True
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors import safe_open

    model_dir = Path(model_dir)
    config = read_config(model_dir)
    files = weight_files(model_dir)
    weights: dict[str, torch.Tensor] = {}
    start = time.perf_counter()
    for i, file in enumerate(files):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                weights[name] = f.get_tensor(name)
        if progress:
            show_progress(f"reading {i + 1}/{len(files)} safetensors files, {len(weights)} "
                          f"tensors ({time.perf_counter() - start:.1f}s)")
    if progress:
        progress_done()
    return config, weights
