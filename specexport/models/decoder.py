"""A static-KV decoder for the llama / mistral / qwen2 / qwen3 families.

Parameter names match transformers' state dicts, so checkpoints load with a strict `load_state_dict`;
`fuse()` then merges q/k/v and gate/up into single projections (loaders always call it; forward needs it).
The KV cache is not owned here: `forward` gets per-layer buffers and writes the new keys and values at
`past_len + arange(T)` for every row, each row at its own position. Nothing is allocated per token
beyond activations; rollback is the caller moving `past_len`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import ort_ops
from .config import ModelConfig
from .rope import apply_rope, rope_tables


@dataclass
class KVCache:
    """Per-layer static buffers. keys[i], values[i]: [max_batch, kv_heads, S, head_dim]."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @classmethod
    def allocate(cls, cfg: ModelConfig, max_batch: int, seq_len: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> "KVCache":
        shape = (max_batch, cfg.num_kv_heads, seq_len, cfg.head_dim)
        return cls([torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)],
                   [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)])

    @property
    def seq_len(self) -> int:
        return self.keys[0].shape[2]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.h, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.h * self.d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.hkv * self.d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.hkv * self.d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.h * self.d, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def fuse(self) -> None:
        """One [q; k; v] projection instead of three: fewer, larger matmuls on the per-token path."""
        self.qkv_proj = _concat_linears([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj

    def _qkv(self, x, cos, sin):
        """x [B, T, hidden] -> q [B, H, T, D], k and v [B, Hkv, T, D], rotated (and q/k-normed where the family
        has it)."""
        T = _static(x.shape[1])
        q, k, v = _linear(self.qkv_proj, x).split([self.h * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        q = q.reshape(-1, T, self.h, self.d)
        k = k.reshape(-1, T, self.hkv, self.d)
        v = v.reshape(-1, T, self.hkv, self.d)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)  # [B, H, T, D]
        k = apply_rope(k.transpose(1, 2), cos, sin)  # [B, Hkv, T, D]
        return q, k, v.transpose(1, 2)

    def forward(self, x, cos, sin, write_idx, mask, k_cache, v_cache, inplace: bool):
        # x: [B, T, hidden]; cos, sin: [B, 1, T, D]; write_idx: [B, kv_heads, T, D] long
        # mask: [B, 1, T, L] bool; k_cache, v_cache: [B, kv_heads, S, D]
        # returns out [B, T, hidden] and the caches with the new keys/values written (in place, or as new
        # tensors for ONNX export, where ONNX Runtime binds the same buffer to the input and the output)
        T = _static(x.shape[1])  # batch stays symbolic (-1) in exported graphs
        q, k, v = self._qkv(x, cos, sin)
        if inplace:
            k_cache.scatter_(2, write_idx, k)
            v_cache.scatter_(2, write_idx, v)
        else:
            k_cache, v_cache = k_cache.scatter(2, write_idx, k), v_cache.scatter(2, write_idx, v)
        L = mask.shape[-1]
        out = _attention(q, k_cache[:, :, :L], v_cache[:, :, :L], mask)  # [B, H, T, D]
        return _linear(self.o_proj, out.transpose(1, 2).reshape(-1, T, self.h * self.d)), k_cache, v_cache

    def forward_pending(self, x, cos, sin, bias_c, bias_p, k_prefix, v_prefix, k_pend, v_pend):
        # Attention over a read-only cache prefix and the pending keys/values of this graph's earlier passes;
        # this pass's keys/values are appended to the pending ones instead of being written to the cache.
        # x: [B, T, hidden]; k_prefix, v_prefix: [B, Hkv, L, D]; k_pend, v_pend: [B, Hkv, P, D] or None;
        # bias_c: [B, 1, G*T, L] or [B, 1, 1, L] additive (0 / -inf);
        # bias_p: [T, P+T] additive, causal over pending + new
        # returns out [B, T, hidden], k_pend, v_pend [B, Hkv, P+T, D]
        T = _static(x.shape[1])
        q, k, v = self._qkv(x, cos, sin)
        if k_pend is not None:
            k, v = torch.cat([k_pend, k], 2), torch.cat([v_pend, v], 2)  # [B, Hkv, P+T, D]
        G = self.h // self.hkv
        qg = q.reshape(-1, self.hkv, G * T, self.d)  # query rows in (group, t) order
        scale = self.d ** -0.5
        s_c = torch.matmul(qg, k_prefix.transpose(2, 3)) * scale + bias_c  # [B, Hkv, G*T, L]
        s_p = torch.matmul(qg, k.transpose(2, 3)) * scale + bias_p.repeat(G, 1)  # [B, Hkv, G*T, P+T]
        probs = torch.cat([s_c, s_p], -1).float().softmax(-1).to(v.dtype)
        L = s_c.shape[-1]
        out = torch.matmul(probs[..., :L], v_prefix) + torch.matmul(probs[..., L:], v)  # [B, Hkv, G*T, D]
        out = out.reshape(-1, self.h, T, self.d)
        return _linear(self.o_proj, out.transpose(1, 2).reshape(-1, T, self.h * self.d)), k, v

    def forward_fused(self, x, seqlens_k, total_len, cos, sin, k_cache, v_cache, window, rows2: bool = False):
        # The fused graph set: one GroupQueryAttention node does rotary, the in-place cache write and attention.
        # x: [B, T, hidden]; seqlens_k: [B] int32 (each row's last position); total_len: int32 scalar;
        # cos, sin: [max_positions, D/2]; rows2: T = 1, attention over the token twice (run_fused);
        # returns out [B, T, hidden] and the written caches
        qkv = _fused_linear(self.qkv_proj, x)  # [B, T, (H + 2 Hkv) D]
        if rows2:
            qkv = torch.cat([qkv, qkv], 1)
        T = _static(qkv.shape[1])
        # (export packs q/k/v back into GroupQueryAttention's one input where nothing sits between: onnx_graphs.py)
        q, k, v = qkv.split([self.h * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        if self.qk_norm:  # qwen3: per-head RMSNorm before rotary
            q = ort_ops.rms_norm(q.reshape(-1, T, self.h, self.d), self.q_norm.weight, self.q_norm.eps)
            k = ort_ops.rms_norm(k.reshape(-1, T, self.hkv, self.d), self.k_norm.weight, self.k_norm.eps)
            q, k = q.reshape(-1, T, self.h * self.d), k.reshape(-1, T, self.hkv * self.d)
        out, k_cache, v_cache = ort_ops.gqa(q, k, v, k_cache, v_cache, seqlens_k, total_len, cos, sin, self.h,
                                            self.hkv, window)
        if rows2:
            out = out[:, :1]
        return _fused_linear(self.o_proj, out), k_cache, v_cache


def _linear(lin: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """[..., in] -> [..., out] through a 2-D matmul. Traced, it always carries a bias (a broadcast zero when the
    layer has none) so that ONNX export emits Gemm(transB=1) over the stored weight: no transposed copy of
    it, and a tied lm_head shares the embedding's initializer."""
    if not isinstance(lin, nn.Linear):  # a QuantLinear (models/quant.py): MatMulNBits over [B, T, in] as it is
        return lin(x)
    T = _static(x.shape[1])  # x: [B, T, in]
    x2 = x.reshape(-1, lin.in_features)
    bias = lin.bias
    if bias is None and torch.jit.is_tracing():
        bias = torch.zeros(1, dtype=x.dtype, device=x.device)
    return F.linear(x2, lin.weight, bias).reshape(-1, T, lin.out_features)


def _fused_linear(lin: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The fused graph set's linear: [B, T, in] -> [B, T, out] as one FusedMatMul (float) or MatMulNBits
    (QuantLinear) node, without the 2-D reshapes that Gemm needs."""
    if not isinstance(lin, nn.Linear):
        return lin(x)
    return ort_ops.linear(x, lin.weight, lin.bias)


def _static(n) -> int:
    """A size fixed per step graph (tokens per pass), as a Python int: exported, it is a constant, not a chain
    of Shape/Gather/Concat nodes run on every call. Batch and key length stay symbolic (-1, key_pos)."""
    return int(n)


def _attention(q, k, v, mask):
    """Grouped-query attention without repeating K/V. q: [B, H, T, D]; k, v: [B, Hkv, L, D]; mask [B, 1, T, L]."""
    _, H, T, D = q.shape
    Hkv = k.shape[1]
    if not torch.jit.is_tracing():  # eager: the fused kernel
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=H != Hkv)
    # traced for export: plain ops every runtime has; query heads grouped per kv head (G = H / Hkv), with
    # mask here the additive bias [B, 1, G*T, L] made once per pass (grouped_mask_bias)
    H, Hkv, T, D = int(H), int(Hkv), _static(T), int(D)
    qg = q.reshape(-1, Hkv, (H // Hkv) * T, D)
    scores = torch.matmul(qg, k.transpose(2, 3)) * (D ** -0.5) + mask  # [B, Hkv, G*T, L]
    probs = scores.float().softmax(-1).to(v.dtype)
    return torch.matmul(probs, v).reshape(-1, H, T, D)


def grouped_mask_bias(mask: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """mask [B, 1, T, L] bool -> additive bias [B, 1, G*T, L] (0 or -inf), query rows in (group, t) order."""
    return torch.zeros((), dtype=dtype).masked_fill(~mask, float("-inf")).repeat(1, 1, groups, 1)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def fuse(self) -> None:
        self.gate_up_proj = _concat_linears([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    def forward(self, x):
        gate, up = _linear(self.gate_up_proj, x).split(self.down_proj.in_features, dim=-1)  # static sizes: one Split
        return _linear(self.down_proj, F.silu(gate) * up)

    def forward_fused(self, x):
        gate, up = _fused_linear(self.gate_up_proj, x).split(self.down_proj.in_features, dim=-1)
        return _fused_linear(self.down_proj, ort_ops.silu(gate) * up)


def _concat_linears(parts: list[nn.Linear]) -> nn.Linear:
    w = torch.cat([p.weight for p in parts])
    fused = nn.Linear(w.shape[1], w.shape[0], bias=parts[0].bias is not None, dtype=w.dtype, device=w.device)
    fused.weight = nn.Parameter(w, requires_grad=False)
    if parts[0].bias is not None:
        fused.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
    return fused


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, write_idx, mask, k_cache, v_cache, inplace: bool):
        h, k_cache, v_cache = self.self_attn(self.input_layernorm(x), cos, sin, write_idx, mask, k_cache, v_cache,
                                             inplace)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), k_cache, v_cache

    def forward_pending(self, x, cos, sin, bias_c, bias_p, k_prefix, v_prefix, k_pend, v_pend):
        h, k_pend, v_pend = self.self_attn.forward_pending(self.input_layernorm(x), cos, sin, bias_c, bias_p,
                                                           k_prefix, v_prefix, k_pend, v_pend)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), k_pend, v_pend


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class StaticKVDecoder(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.max_positions = max_positions
        # "fused": run_fused (ONNX Runtime's fused ops) when traced for the fused graph set; "fused_rows2": the
        # same with each layer's attention over every token twice (the exact 1-token step, see run_fused)
        self.ops = "portable"
        self.head_search = None  # a CertifiedHead (models/certified.py): the fused greedy graphs' argmax
        self._set_rope(torch.float32)

    def fuse(self) -> "StaticKVDecoder":
        """After loading weights: fuse q/k/v and gate/up projections (state-dict names no longer apply)."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        return self

    def _set_rope(self, dtype: torch.dtype) -> None:
        cos, sin = rope_tables(self.cfg, self.max_positions, dtype)
        self.register_buffer("rope_cos", cos, persistent=False)  # [max_positions, D]
        self.register_buffer("rope_sin", sin, persistent=False)
        half = self.cfg.head_dim // 2  # GroupQueryAttention's tables: one half of the rotate-half layout
        self.register_buffer("rope_cos_half", cos[:, :half].contiguous(), persistent=False)  # [max_positions, D/2]
        self.register_buffer("rope_sin_half", sin[:, :half].contiguous(), persistent=False)

    def forward(self, tokens: torch.Tensor, past_len: torch.Tensor, cache: KVCache, kv_len: int,
                logits_index: torch.Tensor | None = None) -> torch.Tensor:
        """Eager convenience over `run`: rows 0..B-1 of `cache`, attention over its first kv_len positions."""
        B = tokens.shape[0]
        key_pos = torch.arange(kv_len, device=tokens.device)
        return self.run(tokens, past_len, key_pos, [k[:B] for k in cache.keys], [v[:B] for v in cache.values],
                        logits_index)[0]

    def run(self, tokens: torch.Tensor, past_len: torch.Tensor, key_pos: torch.Tensor, keys: list[torch.Tensor],
            values: list[torch.Tensor], logits_index: torch.Tensor | None = None, inplace: bool = True,
            argmax: bool = False):
        """Run T tokens per row at positions past_len[b] + arange(T), writing their KV into the caches.

        tokens: [B, T] long; past_len: [B] long; key_pos: [L] long = arange(L), the cache prefix attention reads
        (L >= max(past_len) + T; later positions are masked anyway); keys, values: per layer [B, Hkv, S, D].
        logits_index: [B] long, the one position per row whose logits are wanted, or None for all.
        inplace: write the caches in place (eager, TorchScript) or return new ones (ONNX export).
        argmax: return the logits' argmax [B, T] (long) in their place (greedy graphs; fused: the certified head's).
        returns logits [B, T, V] (or [B, 1, V] with logits_index) in fp32, keys, values.
        """
        if self.ops.startswith("fused"):
            return self.run_fused(tokens, past_len, key_pos, keys, values, logits_index, argmax)
        T = _static(tokens.shape[1])
        S = keys[0].shape[2]
        cfg = self.cfg
        positions = past_len[:, None] + torch.arange(T, device=tokens.device)  # [B, T]
        rope_pos = positions.clamp(max=self.max_positions - 1)
        cos = self.rope_cos[rope_pos].unsqueeze(1)  # [B, 1, T, D]
        sin = self.rope_sin[rope_pos].unsqueeze(1)
        # Rows padded past their end write garbage beyond their valid length; clamping keeps it in bounds.
        write_idx = positions.clamp(max=S - 1)[:, None, :, None].expand(-1, cfg.num_kv_heads, T, cfg.head_dim)
        mask = key_pos <= positions[:, :, None]  # [B, T, L]
        if cfg.sliding_window is not None:
            mask = mask & (key_pos > positions[:, :, None] - cfg.sliding_window)
        mask = mask[:, None]  # [B, 1, T, L]
        x = self.model.embed_tokens(tokens)
        if torch.jit.is_tracing():
            mask = grouped_mask_bias(mask, cfg.num_heads // cfg.num_kv_heads, x.dtype)
        keys, values = list(keys), list(values)
        for i, layer in enumerate(self.model.layers):
            x, keys[i], values[i] = layer(x, cos, sin, write_idx, mask, keys[i], values[i], inplace)
        if logits_index is not None:
            x = x.gather(1, logits_index[:, None, None].expand(-1, 1, cfg.hidden_size))  # [B, 1, hidden]
        logits = _linear(self.lm_head, self.model.norm(x)).float()
        return (logits.argmax(-1) if argmax else logits), keys, values

    def run_fused(self, tokens, past_len, key_pos, keys, values, logits_index=None, argmax: bool = False):
        """`run` over ONNX Runtime's fused ops (models/ort_ops.py): per layer two norm nodes, the linears, one
        GroupQueryAttention writing the caches in place. Same inputs and outputs as `run` (always out of place,
        as exported); batch > 1 with T > 1 runs only eagerly (ONNX Runtime's kernel refuses it)."""
        T = _static(tokens.shape[1])
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        # rows2 (a 1-token pass): attention sees the token at past_len and again at past_len + 1 (dropped after),
        # so that ONNX Runtime runs its multi-row attention kernel, which rounds as in every verify pass; the
        # linears stay 1-row (their kernels agree across row counts)
        rows2 = self.ops == "fused_rows2"
        assert not rows2 or T == 1
        seqlens_k = (past_len + (T - 1 + rows2)).to(torch.int32)  # [B]: each row's last attention position
        total_len = (key_pos[-1] + 1).to(torch.int32)  # L, as a scalar
        layers = self.model.layers
        residual = self.model.embed_tokens(tokens)  # [B, T, hidden]
        x = ort_ops.rms_norm(residual, layers[0].input_layernorm.weight, eps)
        keys, values = list(keys), list(values)
        for i, layer in enumerate(layers):
            h, keys[i], values[i] = layer.self_attn.forward_fused(x, seqlens_k, total_len, self.rope_cos_half,
                                                                  self.rope_sin_half, keys[i], values[i],
                                                                  cfg.sliding_window, rows2)
            x, residual = ort_ops.add_rms_norm(h, residual, layer.post_attention_layernorm.weight, eps)
            nxt = layers[i + 1].input_layernorm.weight if i + 1 < len(layers) else self.model.norm.weight
            # x: the next layer's (or the final) normed input
            x, residual = ort_ops.add_rms_norm(layer.mlp.forward_fused(x), residual, nxt, eps)
        if logits_index is not None:
            x = x.gather(1, logits_index[:, None, None].expand(-1, 1, cfg.hidden_size))  # [B, 1, hidden]
        if argmax and self.head_search is not None:
            return self.head_search(x, self.lm_head.weight), keys, values
        logits = _fused_linear(self.lm_head, x).float()
        return (logits.argmax(-1) if argmax else logits), keys, values

    def run_pending(self, tokens: torch.Tensor, prefix_len: torch.Tensor, key_pos: torch.Tensor,
                    k_prefix: list[torch.Tensor], v_prefix: list[torch.Tensor], k_pend: list | None,
                    v_pend: list | None, logits_index: torch.Tensor):
        """A pass that writes no cache (the fused draft graph's passes, see steps.DraftStep).

        tokens: [B, T] long at positions prefix_len[b] + P + arange(T), where P is the pending length;
        prefix_len: [B] long, cache positions < prefix_len are valid; key_pos: [L] = arange(L);
        k_prefix, v_prefix: per layer [B, Hkv, L, D], read only; k_pend, v_pend: per layer [B, Hkv, P, D]
        (None when P = 0), the keys/values earlier passes computed; logits_index: [B].
        returns logits [B, 1, V] fp32 and the pending keys/values with this pass's appended [B, Hkv, P+T, D].
        """
        T = _static(tokens.shape[1])
        P = 0 if k_pend is None else _static(k_pend[0].shape[2])
        cfg = self.cfg
        positions = prefix_len[:, None] + P + torch.arange(T, device=tokens.device)  # [B, T]
        rope_pos = positions.clamp(max=self.max_positions - 1)
        cos = self.rope_cos[rope_pos].unsqueeze(1)  # [B, 1, T, D]
        sin = self.rope_sin[rope_pos].unsqueeze(1)
        x = self.model.embed_tokens(tokens)
        ninf = torch.tensor(float("-inf"), dtype=x.dtype)
        zero = torch.zeros((), dtype=x.dtype)
        valid = (key_pos < prefix_len[:, None])[:, None, None]  # [B, 1, 1, L]: every query sees the same prefix
        bias_c = torch.where(valid, zero, ninf)
        if cfg.sliding_window is not None:  # ... but for the window
            valid = valid & (key_pos > positions[:, None, :, None] - cfg.sliding_window)  # [B, 1, T, L]
            bias_c = grouped_mask_bias(valid, cfg.num_heads // cfg.num_kv_heads, x.dtype)  # [B, 1, G*T, L]
        j, t = torch.arange(P + T)[None], P + torch.arange(T)[:, None]  # key and query offsets from prefix_len
        seen = j <= t
        if cfg.sliding_window is not None:
            seen = seen & (j > t - cfg.sliding_window)
        bias_p = torch.where(seen, zero, ninf)  # [T, P+T]
        new_k, new_v = [], []
        for i, layer in enumerate(self.model.layers):
            x, pk, pv = layer.forward_pending(x, cos, sin, bias_c, bias_p, k_prefix[i], v_prefix[i],
                                              None if k_pend is None else k_pend[i],
                                              None if v_pend is None else v_pend[i])
            new_k.append(pk)
            new_v.append(pv)
        x = x.gather(1, logits_index[:, None, None].expand(-1, 1, cfg.hidden_size))  # [B, 1, hidden]
        return _linear(self.lm_head, self.model.norm(x)).float(), new_k, new_v


def random_decoder(cfg: ModelConfig, max_positions: int, seed: int = 0, logit_scale: float = 1.0,
                   like: StaticKVDecoder | None = None, noise: float = 0.0, dtype: torch.dtype = torch.float32,
                   device: torch.device | str = "cpu") -> StaticKVDecoder:
    """A fused decoder with random weights (torch's default init, seeded, run on `device` in `dtype`: the same
    seed gives other weights on another device type or dtype), for tests and the GPU self-test: no checkpoint, no
    transformers. logit_scale sharpens its distributions (scales the final norm); like + noise: another decoder's
    weights plus gaussian noise of std `noise` (a draft that partly agrees)."""
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialised in the final dtype: no fp32 copy of a large model on the way
    try:
        with torch.device(device):
            model = StaticKVDecoder(cfg, max_positions).fuse().eval().requires_grad_(False)
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        if like is not None:
            g = torch.Generator(device=device).manual_seed(seed)
            for p, q in zip(model.parameters(), like.parameters()):
                p.copy_(q.float() + torch.randn(p.shape, generator=g, device=p.device) * noise)
        else:
            model.model.norm.weight.mul_(logit_scale)
    return model.to(dtype)
