"""A GGUF model's work per step, from its header alone (no weights loaded): its shapes, the
bytes each benchmarked system reads in a decode step, and the FLOPs of a token. Bytes are each
tensor's own in the file (GGUF n_bytes: the blocks of its type), never an assumed format.

What it is not: the machine's speed (scripts/compute_bound.py measures it and divides) or the
report's ratios (peer_report.py).
"""

from __future__ import annotations

# The weights FreeToken fuses into one linear (model/llama.py); GGUFBlocks.fuse keeps the blocks
# of a fused group only when every part has blocks of one type, else the group runs fp32 panels.
FUSED = (("attn_q.weight", "attn_k.weight", "attn_v.weight"),
         ("ffn_gate.weight", "ffn_up.weight"))


def model_shape(path: str) -> dict:
    """Architecture numbers and weight bytes read from the GGUF header (no weights loaded).

    Bytes are each tensor's own in the file (GGUF n_bytes: the blocks of its type, Q4_K's 144
    bytes per 256 values, Q6_K's 210, Q8_0's 34 per 32, ...); `step_tensors` are the tensors a
    decode step reads: every one but the embedding (one row of it), unless the embedding is the
    lm_head too."""
    from gguf import GGUFReader
    r = GGUFReader(path)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()

    def get(key):
        f = r.fields[f"{arch}.{key}"]
        return int(f.parts[f.data[0]][0])

    names = {t.name for t in r.tensors}
    tied = "output.weight" not in names
    n_params = sum(int(t.n_elements) for t in r.tensors)
    step = [{"name": t.name, "type": t.tensor_type.name, "dims": len(t.shape),
             "shape": [int(n) for n in t.shape], "elements": int(t.n_elements),
             "bytes": int(t.n_bytes)} for t in r.tensors
            if t.name != "token_embd.weight" or tied]
    d = {"arch": arch, "layers": get("block_count"), "hidden": get("embedding_length"),
         "ffn": get("feed_forward_length"), "heads": get("attention.head_count"),
         "kv_heads": get("attention.head_count_kv"),
         "vocab": int(r.fields[f"{arch}.vocab_size"].parts[-1][0])
         if f"{arch}.vocab_size" in r.fields else None,
         "params": n_params, "tied_embeddings": tied,
         "gguf_weight_bytes": sum(int(t.n_bytes) for t in r.tensors),
         "gguf_type_bytes": _by_type((t.tensor_type.name, int(t.n_bytes)) for t in r.tensors),
         "gguf_step_bytes": sum(t["bytes"] for t in step),
         "step_tensors": step}
    if d["vocab"] is None:
        d["vocab"] = int(next(t for t in r.tensors if t.name == "token_embd.weight").shape[1])
    h, hd = d["hidden"], d["hidden"] // d["heads"]
    kv = d["kv_heads"] * hd
    d["head_dim"] = hd
    d["linear_params_per_layer"] = h * h * 2 + h * kv * 2 + 3 * h * d["ffn"]
    d["lm_head_params"] = h * d["vocab"]
    return d


def _by_type(pairs) -> dict[str, int]:
    out: dict[str, int] = {}
    for key, nbytes in pairs:
        out[key] = out.get(key, 0) + nbytes
    return out


def fp32_step_weights(s: dict, block_types=None) -> tuple[int, dict[str, int]]:
    """(bytes, {form: bytes}) of the weights a FreeToken fp32 decode step reads (linear "auto").
    A model over IN_PLACE_MIN_BYTES as fp32 computes on the file's blocks, its Q4_1 / Q4_K /
    Q6_K matrices as block panels, the rest in place; one under it whose matrices all have block
    panels on those (model/linear.py block_panel_types); any other is dequantized at load
    (_dequantized_step_weights).
    `block_types`: the types of the blocks kept (in place: those the kernel takes; dequantized:
    Q4_1 / Q8_0)."""
    from freetoken.model.linear import (
        GGUF_BLOCK_TYPES,
        IN_PLACE_MIN_BYTES,
        block_panel_bytes,
        block_panel_types,
    )

    matrix_types = {t["type"] for t in s["step_tensors"] if t["dims"] >= 2}
    small = 4 * s["params"] <= IN_PLACE_MIN_BYTES
    panel_types = block_panel_types(4 * s["params"], matrix_types)
    if small and not panel_types:
        return _dequantized_step_weights(
            s, GGUF_BLOCK_TYPES if block_types is None else block_types)
    if block_types is None:
        from freetoken.ops.backend import _C

        block_types = tuple(_C.gguf_matrix_types()) if _C is not None else ()
    forms = []
    for parts in _fused_groups(s):
        types = {t["type"] for t in parts}
        panels = len(types) == 1 and types <= panel_types
        for t in parts:
            if t["dims"] < 2:
                forms.append((f"{t['type']} vectors", t["bytes"]))
            elif panels:
                forms.append((f"{t['type']} block panels",
                              block_panel_bytes(t["type"], t["shape"][1], t["shape"][0])))
            elif t["type"] in block_types:
                forms.append((f"{t['type']} blocks", t["bytes"]))
            else:
                forms.append((f"fp32 panels of {t['type']}", 4 * t["elements"]))
    by_form = _by_type(forms)
    return sum(by_form.values()), by_form


def _fused_groups(s: dict) -> list[list[dict]]:
    """The step's tensors grouped as FreeToken fuses them (FUSED); the rest alone."""
    groups: dict[str, list[dict]] = {}
    for t in s["step_tensors"]:
        key = t["name"]
        for group in FUSED:
            if t["name"].endswith(group):
                key = t["name"].rsplit(".", 2)[0] + "/" + "+".join(group)
        groups.setdefault(key, []).append(t)
    return list(groups.values())


def _dequantized_step_weights(s: dict, block_types) -> tuple[int, dict[str, int]]:
    """fp32_step_weights of a model dequantized at load: a matrix whose type is in
    `block_types` (and, in a fused group, every part of one such type) as the file's Q4_1 / Q8_0
    blocks, every other one as fp32 panels (4 bytes a weight); norms as the file has them."""
    forms = []
    for parts in _fused_groups(s):
        types = {t["type"] for t in parts}
        blocks = len(types) == 1 and types <= set(block_types)
        for t in parts:
            if t["dims"] < 2 or blocks:
                forms.append((f"{t['type']} blocks" if t["dims"] >= 2 else
                              f"{t['type']} vectors", t["bytes"]))
            else:
                forms.append((f"fp32 panels of {t['type']}", 4 * t["elements"]))
    by_form = _by_type(forms)
    return sum(by_form.values()), by_form


def int8_step_weights(s: dict) -> tuple[int, dict[str, int]]:
    """(bytes, {form: bytes}) of the weights an int8-mode decode step reads: each matrix of a
    type with an int8 kernel as its repacked copy (ops.int8_matrix: the codes and the file's
    scale numbers, int8_bits_per_weight), the rest as the file's blocks (computed exact)."""
    from freetoken.ops.backend import _C

    types = set(_C.int8_matrix_types()) if _C is not None else set()
    forms = []
    for t in s["step_tensors"]:
        if t["dims"] >= 2 and t["type"] in types:
            bits = _C.int8_bits_per_weight(t["type"])
            forms.append((f"int8 copy of {t['type']}", int(t["elements"] * bits / 8)))
        else:
            forms.append((f"{t['type']} {'blocks' if t['dims'] >= 2 else 'vectors'}",
                          t["bytes"]))
    by_form = _by_type(forms)
    return sum(by_form.values()), by_form


def _forms(by_form: dict[str, int]) -> str:
    return ", ".join(f"{k} {v / 1e6:.{0 if v >= 1e7 else 1}f} MB"
                     for k, v in sorted(by_form.items(), key=lambda kv: -kv[1]))


def flops_per_token(s: dict, ctx: float) -> float:
    """Forward FLOPs of one token through every layer (2 per MAC), attention over ctx keys."""
    lin = 2 * s["linear_params_per_layer"]
    attn = 4 * s["heads"] * s["head_dim"] * ctx  # QK^T and PV
    return s["layers"] * (lin + attn)


def decode_bytes(s: dict, block_types=None) -> dict:
    """What one decode step of each system reads: its weights in the form its decode steps read
    them (bytes, every linear and the lm_head once; the embedding lookup reads one row), and its
    KV per token of context per stream (K and V of every layer). `block_types`: as for
    fp32_step_weights."""
    kv_elems = s["layers"] * 2 * s["kv_heads"] * s["head_dim"]
    linear_params = s["layers"] * s["linear_params_per_layer"] + s["lm_head_params"]
    fp32_weights, fp32_forms = fp32_step_weights(s, block_types)
    file_forms = _by_type((t["type"], t["bytes"]) for t in s["step_tensors"])
    int8_weights, int8_forms = int8_step_weights(s)
    return {
        # the file's blocks or block panels, or fp32 panels (fp32_step_weights)
        "freetoken-fp32": {"weights": fp32_weights, "kv_per_token": 4 * kv_elems,
                           "weights_read_as": f"{_forms(fp32_forms)}, fp32 KV"},
        "freetoken-int8": {"weights": int8_weights, "kv_per_token": 4 * kv_elems,
                           "weights_read_as": f"{_forms(int8_forms)}, fp32 KV"},
        "freetoken-bf16": {"weights": 2 * linear_params, "kv_per_token": 2 * kv_elems,
                           "weights_read_as": "bf16 panels, bf16 KV"},
        "llama-server": {"weights": s["gguf_step_bytes"], "kv_per_token": 2 * kv_elems,
                         "weights_read_as": f"the GGUF's own blocks ({_forms(file_forms)}), "
                                            "f16 KV (its default)"},
    }
