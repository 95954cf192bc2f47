"""ONNX Runtime's fused CPU/CUDA ops (domain com.microsoft) as torch functions, for the `fused` graph set.

Each function computes the op's math eagerly (so a traced step still produces real values, and tests can hold
the eager result against ONNX Runtime's kernel) and exports as one node:

  rms_norm(x, w)                 SimplifiedLayerNormalization           x [.., hidden] -> normed
  add_rms_norm(x, skip, w)       SkipSimplifiedLayerNormalization       -> normed(x + skip), x + skip
  silu(x)                        QuickGelu (alpha = 1)                  x * sigmoid(x)
  linear(x, w)                   FusedMatMul (transB = 1)               x [B, T, in] @ w[out, in]^T, no reshapes
  gqa(q, k, v, k_cache, ...)     GroupQueryAttention (do_rotary=1)      rotary on q and k, k/v written into the
                                                                        caches at their positions, causal (and
                                                                        windowed) grouped attention

GroupQueryAttention updates the static caches in place when a graph's cache input and output are bound to one
buffer (past/present share buffer): no copy and no scatter. Each row b holds its new T tokens at positions
seqlens_k[b] - T + 1 .. seqlens_k[b], so rows sit at their own positions. ONNX Runtime's CPU kernel refuses a
multi-token call with a past at batch > 1; the onnxruntime engine runs such calls row by row (B = 1 each).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd import Function


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class _RMSNorm(Function):
    @staticmethod
    def forward(ctx, x, w, eps):
        return _rms(x, w, eps)

    @staticmethod
    def symbolic(g, x, w, eps):
        y = g.op("SimplifiedLayerNormalization", x, w, axis_i=-1, epsilon_f=eps, stash_type_i=1)
        y.setType(x.type())
        return y


class _AddRMSNorm(Function):
    @staticmethod
    def forward(ctx, x, skip, w, eps):
        s = x + skip
        return _rms(s, w, eps), s

    @staticmethod
    def symbolic(g, x, skip, w, eps):
        y, _, _, s = g.op("com.microsoft::SkipSimplifiedLayerNormalization", x, skip, w, epsilon_f=eps, outputs=4)
        y.setType(x.type())
        s.setType(x.type())
        return y, s


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return _RMSNorm.apply(x, w, eps)


def add_rms_norm(x: torch.Tensor, skip: torch.Tensor, w: torch.Tensor, eps: float):
    """-> (rms_norm(x + skip) * w, x + skip): the residual add and the next norm in one node."""
    return _AddRMSNorm.apply(x, skip, w, eps)


class _SiLU(Function):
    @staticmethod
    def forward(ctx, x):
        return F.silu(x)

    @staticmethod
    def symbolic(g, x):  # QuickGelu(x) = x * sigmoid(alpha * x): SiLU at alpha = 1, one node instead of two
        y = g.op("com.microsoft::QuickGelu", x, alpha_f=1.0)
        y.setType(x.type())
        return y


def silu(x: torch.Tensor) -> torch.Tensor:
    return _SiLU.apply(x)


class _Linear(Function):
    @staticmethod
    def forward(ctx, x, w):
        return F.linear(x, w)

    @staticmethod
    def symbolic(g, x, w):  # the stored [out, in] weight, read transposed (pre-packed like Gemm's)
        y = g.op("com.microsoft::FusedMatMul", x, w, transB_i=1)
        sizes = x.type().varyingSizes()
        y.setType(x.type().with_sizes([*sizes[:-1], w.type().varyingSizes()[0]]) if sizes else x.type())
        return y


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ w [out, in]^T (+ bias): one node for any rank (Gemm needs 2-D input and two Reshapes)."""
    y = _Linear.apply(x, w)
    return y if bias is None else y + bias


def _rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, n, D]; cos, sin [B, T, 1, D/2] (rotate-half layout, as HF's llama)."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


class _GQA(Function):
    @staticmethod
    def forward(ctx, q, k, v, k_cache, v_cache, seqlens_k, total_len, cos, sin, num_heads, kv_heads, window):
        # q [B, T, H*D]; k, v [B, T, Hkv*D]; caches [B, Hkv, S, D]; seqlens_k [B] int32 (last position);
        # total_len: int32 scalar (attention extent bound); cos, sin [max_pos, D/2]; window: keys each query
        # sees, 0 = all
        B, T = q.shape[0], q.shape[1]
        D = k_cache.shape[-1]
        pos = seqlens_k.long()[:, None] - (T - 1) + torch.arange(T)  # [B, T]
        c, s = cos[pos][:, :, None], sin[pos][:, :, None]  # [B, T, 1, D/2]
        qh = _rope_half(q.reshape(B, T, num_heads, D), c, s).transpose(1, 2)  # [B, H, T, D]
        kh = _rope_half(k.reshape(B, T, kv_heads, D), c, s).transpose(1, 2)  # [B, Hkv, T, D]
        vh = v.reshape(B, T, kv_heads, D).transpose(1, 2)
        S = k_cache.shape[2]
        idx = pos.clamp(max=S - 1)[:, None, :, None].expand(-1, kv_heads, T, D)
        k_cache, v_cache = k_cache.scatter(2, idx, kh), v_cache.scatter(2, idx, vh)
        L = int(total_len)
        key = torch.arange(L)
        mask = key <= pos[:, :, None]  # [B, T, L]
        if window:
            mask = mask & (key > pos[:, :, None] - window)
        out = F.scaled_dot_product_attention(qh, k_cache[:, :, :L], v_cache[:, :, :L], attn_mask=mask[:, None],
                                             enable_gqa=num_heads != kv_heads)  # [B, H, T, D]
        return out.transpose(1, 2).reshape(B, T, num_heads * D), k_cache, v_cache

    @staticmethod
    def symbolic(g, q, k, v, k_cache, v_cache, seqlens_k, total_len, cos, sin, num_heads, kv_heads, window):
        out, kc, vc = g.op("com.microsoft::GroupQueryAttention", q, k, v, k_cache, v_cache, seqlens_k, total_len,
                           cos, sin, num_heads_i=num_heads, kv_num_heads_i=kv_heads, do_rotary_i=1,
                           rotary_interleaved_i=0, local_window_size_i=window if window else -1, outputs=3)
        out.setType(q.type())
        kc.setType(k_cache.type())
        vc.setType(v_cache.type())
        return out, kc, vc


def gqa(q, k, v, k_cache, v_cache, seqlens_k, total_len, cos, sin, num_heads: int, kv_heads: int,
        window: int | None):
    """See the module docstring. Returns out [B, T, H*D] and the caches with the new keys/values written."""
    return _GQA.apply(q, k, v, k_cache, v_cache, seqlens_k, total_len, cos, sin, num_heads, kv_heads, window or 0)
