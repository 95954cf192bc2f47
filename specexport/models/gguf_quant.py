"""GGUF quantized tensors as stored: their codes, scales and block minimums in ONNX Runtime's MatMulNBits terms.

Every supported format is one affine rule over blocks of `block` weights along the input dimension K:

    w[n, k] = scale[n, b] * (code[n, k] - zero[n, b]) + min[n, b],      b = k // block

computed in fp32 in exactly the order gguf.quants.dequantize uses, so the dequantized weights are bit for bit
gguf's (tests/models/test_gguf_quant.py checks every format with random blocks):

  format  code bits  block  zero  min          gguf's rule
  Q4_0    4          32     8     -            d * (q - 8)
  Q4_1    4          32     0     m            d * q + m
  Q5_0    8 (5 used) 32     16    -            d * (q - 16)
  Q5_1    8 (5 used) 32     0     m            d * q + m
  Q8_0    8          32     128   -            d * x, x = q - 128 (int8)
  Q4_K    4          32     0     -dmin*m_j    (d*sc_j) * q - dmin*m_j   (8 sub-blocks of 32 per 256)
  Q5_K    8 (5 used) 32     0     -dmin*m_j    likewise with 5-bit q
  Q6_K    8 (6 used) 16     32    -            (d*sc_j) * (q - 32)       (16 sub-blocks of 16 per 256)

MatMulNBits takes 4- or 8-bit codes with integer zero points, so the 5- and 6-bit formats ride in 8-bit codes.
A block minimum has no MatMulNBits term: the exported linear adds min @ blocksum(x), exact (models/quant.py).
Tensors with different rules are joined (the fused q/k/v and gate/up projections) on the finest block and the
widest code, which loses nothing: a block of 32 is two blocks of 16 with the same scale, zero and min.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import SpecExportError

QK_K = 256


@dataclass
class BlockCodes:
    """w = scales * (codes - zeros) + mins, per block of `block` along K (see the module docstring)."""

    codes: np.ndarray  # uint8 [N, K], values < 2**bits
    scales: np.ndarray  # float32 [N, nb]
    zeros: np.ndarray  # uint8 [N, nb]
    mins: np.ndarray | None  # float32 [N, nb], or None (no block minimum)
    bits: int  # 4 | 8
    block: int  # 16 | 32
    fmt: str  # the GGUF format name (e.g. "Q4_1"), or "mixed" after joining different ones

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape

    def dequantize(self) -> np.ndarray:
        """[N, K] float32, in gguf's operation order (scale times the centred code, then the minimum)."""
        N, K = self.codes.shape
        nb = K // self.block
        q = self.codes.reshape(N, nb, self.block).astype(np.float32) - self.zeros[..., None].astype(np.float32)
        w = self.scales[..., None] * q
        if self.mins is not None:
            w = w + self.mins[..., None]
        return w.reshape(N, K)

    def rows(self, index: np.ndarray) -> "BlockCodes":
        """The rows `index` (a row permutation, e.g. llama.cpp's q/k interleave undone)."""
        return BlockCodes(self.codes[index], self.scales[index], self.zeros[index],
                          None if self.mins is None else self.mins[index], self.bits, self.block, self.fmt)

    def with_block(self, block: int) -> "BlockCodes":
        """The same weights over a finer block (block divides self.block)."""
        r = self.block // block
        if r == 1:
            return self
        rep = lambda a: None if a is None else np.repeat(a, r, axis=1)  # noqa: E731
        return BlockCodes(self.codes, rep(self.scales), rep(self.zeros), rep(self.mins), self.bits, block, self.fmt)


def join_rows(parts: list[BlockCodes]) -> BlockCodes:
    """Stack along N (fused projections); differing formats meet on the finest block and the widest code."""
    block, bits = min(p.block for p in parts), max(p.bits for p in parts)
    parts = [p.with_block(block) for p in parts]
    mins = None
    if any(p.mins is not None for p in parts):
        mins = np.concatenate([p.mins if p.mins is not None else np.zeros_like(p.scales) for p in parts])
    fmts = {p.fmt for p in parts}
    return BlockCodes(np.concatenate([p.codes for p in parts]), np.concatenate([p.scales for p in parts]),
                      np.concatenate([p.zeros for p in parts]), mins, bits, block,
                      fmts.pop() if len(fmts) == 1 else "mixed")


def _f16(b: np.ndarray) -> np.ndarray:  # [n, 2] uint8 -> [n] float32
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)[:, 0]


def _nibbles(qs: np.ndarray, group: int) -> np.ndarray:
    """[n, m] bytes -> [n, 2m] codes: per `group` bytes, their low nibbles then their high nibbles (ggml)."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, group) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & np.uint8(0x0F)).reshape(n, -1)


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """[n, 4] bytes (a little-endian uint32) -> [n, count] single bits (Q5_0 / Q5_1)."""
    h = np.ascontiguousarray(qh).view(np.uint32).reshape(-1, 1) >> np.arange(count, dtype=np.uint32).reshape(1, -1)
    return (h & np.uint32(1)).astype(np.uint8)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins (ggml's get_scale_min_k4)."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _blocks(fmt: str, b: np.ndarray):
    """Raw blocks [n, type_size] -> (codes [n, per_block], scales [n, j], zero, mins [n, j] or None, bits, block)."""
    n = b.shape[0]
    if fmt == "Q4_0":
        return _nibbles(b[:, 2:], 16), _f16(b[:, :2])[:, None], 8, None, 4, 32
    if fmt == "Q4_1":
        return _nibbles(b[:, 4:], 16), _f16(b[:, :2])[:, None], 0, _f16(b[:, 2:4])[:, None], 4, 32
    if fmt == "Q5_0":
        q = _nibbles(b[:, 6:], 16) | (_high_bits(b[:, 2:6], 32) << np.uint8(4))
        return q, _f16(b[:, :2])[:, None], 16, None, 8, 32
    if fmt == "Q5_1":
        q = _nibbles(b[:, 8:], 16) | (_high_bits(b[:, 4:8], 32) << np.uint8(4))
        return q, _f16(b[:, :2])[:, None], 0, _f16(b[:, 2:4])[:, None], 8, 32
    if fmt == "Q8_0":
        q = (b[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return q, _f16(b[:, :2])[:, None], 128, None, 8, 32
    if fmt in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[:, :2])[:, None], _f16(b[:, 2:4])[:, None]
        sc, mn = _k_scales(b[:, 4:16])
        if fmt == "Q4_K":
            q = _nibbles(b[:, 16:], 32)
        else:
            qh = b[:, 16:48].reshape(n, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
            q = _nibbles(b[:, 48:], 32) | ((qh & np.uint8(1)).reshape(n, -1) << np.uint8(4))
        return q, d * sc, 0, -(dmin * mn), (4 if fmt == "Q4_K" else 8), 32
    if fmt == "Q6_K":
        ql, qh, scales, d = b[:, :128], b[:, 128:192], b[:, 192:208], _f16(b[:, 208:210])[:, None]
        lo = (ql.reshape(n, -1, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & np.uint8(0x0F)
        hi = (qh.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
        q = lo.reshape(n, -1) | (hi.reshape(n, -1) << np.uint8(4))
        return q, d * scales.view(np.int8).astype(np.float32), 32, None, 8, 16
    raise KeyError(fmt)


QUANTIZED_FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
FLOAT_FORMATS = ("F32", "F16", "BF16")


def block_codes(fmt: str, data: np.ndarray, shape: tuple[int, int]) -> BlockCodes:
    """A GGUF tensor's raw bytes (any shape; rows of whole blocks) -> its BlockCodes, shape (N, K)."""
    if fmt not in QUANTIZED_FORMATS:
        raise SpecExportError(f"GGUF format {fmt} has no MatMulNBits form here; supported as stored: "
                              f"{', '.join(QUANTIZED_FORMATS + FLOAT_FORMATS)} (or build with --dtype fp32)")
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    per_block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[fmt]]
    N, K = shape
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1, type_size)
    codes, scales, zero, mins, bits, block = _blocks(fmt, raw)
    nb = K // block
    scales = scales.astype(np.float32).reshape(N, nb)
    return BlockCodes(codes.reshape(N, K), scales, np.full((N, nb), zero, np.uint8),
                      None if mins is None else mins.astype(np.float32).reshape(N, nb), bits, block, fmt)
