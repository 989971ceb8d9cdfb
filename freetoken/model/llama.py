"""The Llama-shaped decoder forward (Llama 1-3, SmolLM, Mistral, Qwen2, Qwen3) in plain torch.

embed -> [RMSNorm, q/k/v proj (+bias, +q/k norm), RoPE, paged GQA attention, o proj, RMSNorm,
SwiGLU MLP] x L -> final RMSNorm -> lm_head. Numerics follow Hugging Face transformers (RMSNorm in
fp32, rotate_half RoPE with cos/sin computed in fp32), so logits match it.
Weights arrive as a dict keyed by HF parameter names (see `load_weights`); q/k/v and gate/up are
fused into one matmul each. The module holds no per-request state: positions, KV slots and the
block tables come in the ForwardBatch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import contextmanager, nullcontext

import torch
from torch import nn

from freetoken import ops
from freetoken.engine.batch import ForwardBatch, KVCache
from freetoken.model.attention import AttentionMetadata, build_attention_metadata, paged_attention
from freetoken.model.config import ModelConfig
from freetoken.model.linear import (
    FEW_ROWS,
    GGUFBlocks,
    GGUFMatrix,
    Linear,
    linear,
    pack_few_rows,
    pack_weight,
    packed_form,
    packing_available,
)


class GGUFEmbedding(nn.Module):
    """The token embedding read row by row from its GGUF blocks: only the looked-up rows' blocks
    are read, each row exactly its dequantized fp32 value (ops.dequantize_gguf); no fp32 table
    exists."""

    def __init__(self, matrix: GGUFMatrix):
        super().__init__()
        self.matrix = matrix  # the tied lm_head packs it too
        self.table = matrix.row_table()  # [vocab, row bytes], a view of the file's mapping
        self.num_embeddings, self.embedding_dim = matrix.out_features, matrix.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return ops.dequantize_gguf(self.table.index_select(0, ids), self.matrix.types[0],
                                   self.embedding_dim)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x: [..., size], normalised in fp32 and cast back before the weight (as HF does).
        With residual: s = x + residual (the residual stream after a sublayer), -> (norm(s), s).
        One pass in freetoken._C where it serves x (ops.rms_norm), else torch. NOTE: residual
        is updated in place (it is the stream, owned by the forward)."""
        if x.dim() != 2:  # the q/k norms of Qwen3: [T, heads, hd], one norm per head
            return ops.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        return ops.rms_norm(x, self.weight, self.eps, residual)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """[head_dim // 2] fp32 inverse frequencies, with linear / llama3 scaling as in HF."""
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "freq_factors":  # llama.cpp's rope_freqs (Llama 3.1+ GGUFs)
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: long wavelengths divided by `factor`, short ones kept, smooth in between.
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


# NOTE: with OMP_WAIT_POLICY=PASSIVE (which the server and every benchmark set: spinning OpenMP
# threads wreck a shared machine) each parallel region wakes the sleeping workers, ~40 us here. An
# RMSNorm over 224 x 576 fp32 took 194 us on 2 threads and 47 us on one. So the elementwise ops
# between the matmuls run on one thread when the step is small; matmuls and attention keep all.
# torch has no per-op thread count, so this flips torch.set_num_threads around those ops (0.2 us a
# flip pair here). Not set once instead: the glue ops around the layers (embedding, the RoPE rows,
# the hidden-state copy) would wake both threads (~0.3 ms a step), and the fused kernels' own
# split (csrc/elementwise/: >= 32k elements) would change the bf16 classify step's threading.
ONE_THREAD_MAX_ELEMENTS = 1 << 20  # of the [T, hidden] activations; above it, all threads


@contextmanager
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def elementwise_threads(num_tokens: int, hidden_size: int):
    """The context the elementwise ops of a forward over num_tokens run in."""
    small = num_tokens * hidden_size <= ONE_THREAD_MAX_ELEMENTS
    return _one_thread if small and torch.get_num_threads() > 1 else nullcontext


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.scale = self.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        elementwise=nullcontext,
    ) -> torch.Tensor:
        # x: [T, H]; cos, sin: [T, 1, hd]
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        with elementwise():
            q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, nh, hd]
            k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, kvh, hd]
            v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            ops.rope_(q, k, cos, sin)  # in place: q, k are views of this step's qkv output
        # out: [T, nh, hd]
        out = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, elementwise)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(
            config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias
        )
        self.down_proj = Linear(
            config.intermediate_size, config.hidden_size, bias=config.mlp_bias
        )

    def forward(self, x: torch.Tensor, elementwise=nullcontext) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2I]
        with elementwise():
            act = ops.silu_mul(gate_up, self.intermediate_size)  # silu(gate) * up, [T, I]
        return self.down_proj(act)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        self.fused = None  # the layer as one C++ call (ops.decoder_layer), set by fuse()

    def fuse(self) -> bool:
        """Chain this layer's kernels in C++ (ops.decoder_layer) for the steps whose projections
        are all panel-packed: the same results without ~50 us of Python a layer. Call after the
        linears are packed; False (nothing changed) where the extension cannot serve it."""
        attn, mlp, c = self.self_attn, self.mlp, self.config
        if c.qk_norm or not ops.decoder_layer_available(self.input_layernorm.weight):
            return False
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        served = ("panels", "block panels", "gguf", "int8")
        main = [p.weight if packed_form(p.weight) in served else None for p in linears]
        self.fused = ops.decoder_layer(
            self.input_layernorm.weight, self.post_attention_layernorm.weight, main,
            [p.few_rows for p in linears], [p.bias for p in linears],
            num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
            intermediate_size=mlp.intermediate_size, eps=self.input_layernorm.eps,
            scale=attn.scale, window=c.sliding_window, few_rows_max=FEW_ROWS)
        return True

    def forward(self, x, residual, cos, sin, k_cache, v_cache, meta, elementwise=nullcontext):
        """x: the previous layer's MLP output (the embeddings at layer 0, residual None);
        residual: the residual stream before it. -> (this layer's MLP output, residual stream);
        each sublayer's output joins the stream inside the next RMSNorm (one pass)."""
        kn = meta.kernel
        if self.fused is not None and kn is not None and self.fused.serves(x.shape[0]):
            return self.fused.forward(x, residual, cos, sin, k_cache, v_cache, kn.block_tables,
                                      kn.seq_lens, kn.query_start_loc, meta.slot_mapping)
        with elementwise():
            if residual is None:
                h, residual = self.input_layernorm(x), x
            else:
                h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, k_cache, v_cache, meta, elementwise)
        with elementwise():
            h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h, elementwise), residual


def _last_rows(batch: ForwardBatch):
    """(rows, query_start_loc) of the step's logits rows, where each is the last row of its
    sequence and some rows are not logits rows (CPU int64 tensors: rows [N]; 0, 1, .., N, one
    step at each sequence that has its row); else None."""
    n = int(batch.logits_indices.shape[0])
    if n == 0 or n >= batch.num_tokens or batch.logits_indices.device.type != "cpu":
        return None
    rows = batch.logits_indices.tolist()
    qsl = batch.query_start_loc
    last = {qsl[s + 1] - 1: s for s in range(len(qsl) - 1) if qsl[s + 1] > qsl[s]}
    if any(r not in last for r in rows) or rows != sorted(set(rows)):
        return None
    has = {last[r] for r in rows}
    starts = [0]
    for s in range(len(qsl) - 1):
        starts.append(starts[-1] + (s in has))
    return batch.logits_indices, torch.tensor(starts, dtype=torch.long)


class LlamaForCausalLM(nn.Module):
    """forward(batch, kv) -> hidden [N, H] at batch.logits_indices; compute_logits -> [N, V] fp32.

    Contract (docs/architecture.md): forward writes K/V of all T tokens at batch.slot_mapping into
    kv.k[layer] / kv.v[layer] and their final-norm hidden states into kv.hidden[slot_mapping]
    (with outputs_only, maybe only the logits rows'; kv.hidden_valid marks which).
    Sequence s attends causally over its whole context 0..seq_lens[s]-1, read from its blocks, so
    the prefix may come from an earlier step or another sequence (prefix cache).
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        # NOTE: _weight skips the random init: on the meta device (build_model) that init, like
        # any meta arithmetic, imports torch._dynamo (~70 MiB resident, ~1 s). load_weights sets
        # every weight.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lm_head_packed: torch.Tensor | None = None  # packed copy of a tied lm_head (CPU),
        # or the descriptor of the embedding's GGUF blocks
        self.lm_head_few_rows: torch.Tensor | None = None  # and its bf16 panels (pack_few_rows)
        with torch.device("cpu"):  # NOTE: as for the embedding: meta arithmetic imports dynamo
            inv_freq = rope_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._rope_tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # rope()

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the model's parameters', its norms included)."""
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @property
    def logits_width(self) -> int:
        """Columns of the lm_head (>= vocab_size when the checkpoint pads it)."""
        if self.lm_head is None:
            return int(self.embed_tokens.num_embeddings)
        return self.lm_head.out_features

    def num_parameters(self) -> int:
        """The weights' count, those packed or left in GGUF blocks counted as [out, in] (a packed
        form's header and padding, a descriptor's addresses are not parameters)."""
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        packed = {id(m.weight) for m in linears}  # panels, oneDNN or descriptors: not [out, in]
        n = sum(p.numel() for p in self.parameters() if id(p) not in packed)
        n += sum(m.in_features * m.out_features for m in linears)
        if isinstance(self.embed_tokens, GGUFEmbedding):
            n += self.embed_tokens.num_embeddings * self.embed_tokens.embedding_dim
        return n

    def rope(self, positions: torch.Tensor, dtype: torch.dtype, num_positions: int):
        """positions: [T] int64, all < num_positions -> cos, sin: [T, 1, hd] in `dtype`: rows of
        a table computed in fp32 as HF does (a position's values do not depend on the batch).
        NOTE: one index_select each, not the six small ops of computing them: each distinct op
        costs ~45 us on a decode step here, its code cold after the layers' weight streams."""
        key = (dtype, self.inv_freq.device)
        table = self._rope_tables.get(key)
        have = 0 if table is None else table[0].shape[0]
        if have < num_positions:
            n = max(num_positions, 2 * have, 256)  # doubling: a few rebuilds per server
            inv_freq = self.inv_freq.float()
            freqs = torch.arange(n, device=inv_freq.device).float()[:, None] * inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)  # [n, hd]
            table = emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]
            self._rope_tables[key] = table
        return table[0].index_select(0, positions), table[1].index_select(0, positions)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVCache, outputs_only: bool = False
                ) -> torch.Tensor:
        """outputs_only: where the logits rows are each the last of its sequence's rows and
        the layers run as one call (a prefill or classify step without prompt logprobs), the
        last layer goes on past its attention's K/V with those rows only, and the step's other
        slots are left without a hidden state (kv.hidden_valid False; Runner recomputes one
        where prompt logprobs need it). NOTE: as llama.cpp's inp_out_ids; the last layer's
        attention output, o_proj and MLP at the other rows feed nothing but kv.hidden."""
        elementwise = elementwise_threads(batch.num_tokens, self.config.hidden_size)
        with elementwise():  # NOTE: on 2 threads these few small ops cost ~0.3 ms a step
            x = self.embed_tokens(batch.input_ids)  # [T, H]
            cos, sin = self.rope(batch.positions, x.dtype, max(batch.seq_lens))
        meta = build_attention_metadata(
            batch, kv.block_size, self.config.sliding_window, dtype=x.dtype
        )
        out = _last_rows(batch) if outputs_only else None
        stacked = self._stacked_layers(x, cos, sin, kv, meta, out)
        if stacked is not None:
            x, residual = stacked
        else:
            out, residual = None, None
            for i, layer in enumerate(self.layers):
                x, residual = layer(x, residual, cos, sin, kv.k[i], kv.v[i], meta, elementwise)
        with elementwise():
            x, _ = self.norm(x, residual)  # [T, H], or [N, H] at the logits rows (out)
            # index_copy_, not advanced indexing: 3 us against 50 here
            if out is None:
                kv.hidden.index_copy_(0, batch.slot_mapping, x.to(kv.hidden.dtype))
                kv.hidden_valid.index_fill_(0, batch.slot_mapping, True)
                return x.index_select(0, batch.logits_indices)  # [N, H]
            slots = batch.slot_mapping.index_select(0, batch.logits_indices)
            kv.hidden_valid.index_fill_(0, batch.slot_mapping, False)
            kv.hidden.index_copy_(0, slots, x.to(kv.hidden.dtype))
            kv.hidden_valid.index_fill_(0, slots, True)
            return x

    def _stacked_layers(self, x, cos, sin, kv: KVCache, meta, out=None):
        """Every layer fused and serving the step: all of them in one C++ call
        (ops.decoder_stack, the same results as calling each layer) -> (out, residual); else
        None, and the layers run one by one. out: (rows, query_start_loc) of the last layer's
        rows (_last_rows), or None: all."""
        kn = meta.kernel
        if kn is None:
            return None
        fused = [layer.fused for layer in self.layers]
        if any(f is None for f in fused):
            return None
        rows, qsl = out if out is not None else (None, None)
        return ops.decoder_stack(fused, x, cos, sin, kv.k, kv.v, kn.block_tables, kn.seq_lens,
                                 kn.query_start_loc, meta.slot_mapping, rows, qsl)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, H] -> [N, V] fp32
        if self.lm_head is not None:
            return self.lm_head(hidden.to(self.dtype)).float()
        weight = self.lm_head_packed if self.lm_head_packed is not None else self.lm_head_weight
        return linear(hidden.to(self.dtype), weight, None, self.lm_head_few_rows).float()

    def projections(self):
        """(module, the HF weight names fused into its weight) of every projection."""
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            yield layer.self_attn.qkv_proj, [p + f"self_attn.{n}_proj.weight" for n in "qkv"]
            yield layer.self_attn.o_proj, [p + "self_attn.o_proj.weight"]
            yield layer.mlp.gate_up_proj, [p + f"mlp.{n}_proj.weight" for n in ("gate", "up")]
            yield layer.mlp.down_proj, [p + "mlp.down_proj.weight"]

    def pack_linears(self, matrices: dict[str, GGUFMatrix] | None = None,
                     blocks: dict[str, GGUFBlocks] | None = None,
                     on_packed: Callable[[int, int], None] | None = None) -> str:
        """Pack every projection and the lm_head (CPU; panels or oneDNN, see model/linear.py),
        with the GGUF blocks of their weights (`blocks`, HF names; consumed) as the form for few
        rows where those serve; or give them the descriptors of their GGUF blocks in place
        (`matrices`, HF names; consumed). A tied lm_head gets its own packed copy (the embedding
        lookup needs the plain rows: vocab x hidden more memory), or the embedding's blocks'
        descriptor. Returns the form: "gguf", "panels", "onednn", or "plain" (nothing changed:
        packing is not available). `on_packed(done, total)` is called after each projection
        (the loader's progress line: repacking a 1B file's blocks takes ~2 s)."""
        matrices = matrices if matrices is not None else {}
        blocks = blocks if blocks is not None else {}
        if not matrices and not packing_available(self.norm.weight):
            return "plain"
        for i, (module, names) in enumerate(self.projections()):
            module.pack(GGUFMatrix.fuse([matrices.pop(n, None) for n in names]),
                        GGUFBlocks.fuse([blocks.pop(n, None) for n in names]))
            if on_packed is not None:
                on_packed(i + 1, 4 * len(self.layers))
        if self.lm_head is not None:
            self.lm_head.pack(matrices.pop("lm_head.weight", None),
                              blocks.pop("lm_head.weight", None))
        elif isinstance(self.embed_tokens, GGUFEmbedding):
            self.lm_head_packed = self.embed_tokens.matrix.pack()
        else:
            weight = self.embed_tokens.weight
            self.lm_head_packed = pack_weight(weight)
            self.lm_head_few_rows = pack_few_rows(weight,
                                                  blocks.pop("model.embed_tokens.weight", None))
        matrices.clear()
        blocks.clear()
        for layer in self.layers:
            layer.fuse()
        return packed_form(self.layers[0].self_attn.qkv_proj.weight)

    def make_kv_cache(self, num_blocks: int, block_size: int) -> KVCache:
        """A KVCache shaped for this model, on its device and in its dtype."""
        c = self.config
        return KVCache(
            c.num_layers,
            num_blocks,
            block_size,
            c.num_kv_heads,
            c.head_dim,
            c.hidden_size,
            self.dtype,
            self.device,
        )

    @torch.no_grad()
    def load_weights(
        self, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device | str,
        in_place: frozenset[str] | set[str] = frozenset(),
    ) -> None:
        """Install HF-named weights (`model.layers.0.self_attn.q_proj.weight`, ...), fusing q/k/v
        and gate/up, on a model built on the meta device. Consumes `weights` (pops each tensor as
        it is used, so peak memory stays near one copy of the model). `in_place`: the names whose
        weights stay in GGUF blocks (pack_linears installs them; the embedding here is given
        by the caller). Raises ValueError naming any missing, unexpected or misshapen tensor."""
        if self.lm_head is None:
            weights.pop("lm_head.weight", None)

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"checkpoint is missing tensor {name!r}")
            return weights.pop(name)

        def put(module: nn.Module, attr: str, names: list[str]) -> None:
            parts = [take(n) for n in names]
            value = parts[0] if len(parts) == 1 else torch.cat(parts, 0)
            expected = getattr(module, attr).shape
            if tuple(value.shape) != tuple(expected):
                raise ValueError(
                    f"tensor {names[0]!r} has shape {tuple(parts[0].shape)}; the "
                    f"config implies {tuple(expected)} (fused over {len(names)})"
                )
            value = value.to(device=device, dtype=dtype).contiguous()
            setattr(module, attr, nn.Parameter(value, requires_grad=False))

        if "model.embed_tokens.weight" not in in_place:
            put(self.embed_tokens, "weight", ["model.embed_tokens.weight"])
        put(self.norm, "weight", ["model.norm.weight"])
        if self.lm_head is not None and "lm_head.weight" not in in_place:
            put(self.lm_head, "weight", ["lm_head.weight"])
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            put(layer.input_layernorm, "weight", [p + "input_layernorm.weight"])
            put(layer.post_attention_layernorm, "weight", [p + "post_attention_layernorm.weight"])
            if attn.qkv_proj.bias is not None:
                put(attn.qkv_proj, "bias", [p + f"self_attn.{n}_proj.bias" for n in "qkv"])
            if attn.o_proj.bias is not None:
                put(attn.o_proj, "bias", [p + "self_attn.o_proj.bias"])
            if attn.q_norm is not None:
                put(attn.q_norm, "weight", [p + "self_attn.q_norm.weight"])
                put(attn.k_norm, "weight", [p + "self_attn.k_norm.weight"])
            if mlp.down_proj.bias is not None:
                put(mlp.gate_up_proj, "bias", [p + f"mlp.{n}_proj.bias" for n in ("gate", "up")])
                put(mlp.down_proj, "bias", [p + "mlp.down_proj.bias"])
        for module, names in self.projections():
            if names[0] not in in_place:
                put(module, "weight", names)
        leftover = sorted(k for k in weights if not k.endswith("rotary_emb.inv_freq"))
        if leftover:
            raise ValueError(
                f"checkpoint has unexpected tensors: {leftover[:5]}"
                + (f" (+{len(leftover) - 5} more)" if len(leftover) > 5 else "")
            )
        # RoPE frequencies stay fp32 whatever the model dtype, as in transformers.
        self.inv_freq = rope_inv_freq(self.config).to(device)
