"""Block quantization for ZeRO++-style quantized collectives (qwZ, qgZ): symmetric int8 / int4 codes with one
fp32 scale per block, packed into one byte buffer per row so a row travels as a single collective payload.

[Note: block quantization]
A row of n values is cut into ceil(n / block) blocks of ``block`` elements (the last one zero-padded). For each
block, scale = max|x| / L with L = 127 (int8) or 7 (int4); each value is coded as q = round(x / scale), clamped
to [-L, L], and decoded as q x scale. Error bound per element (exact arithmetic): |x - q(x) x scale| <= scale / 2,
i.e. at most max|x| / 254 (int8) or max|x| / 14 (int4) of the block's largest magnitude; a block of zeros is
exact. In fp32 the division and product add a relative rounding of a few ulps of scale (tests allow 1e-6 of it).
A block holding an inf or a NaN has a non-finite scale and decodes to NaN in every element: an overflow is never
hidden by quantization (fp16 loss scaling then skips the step on every rank, as without quantization).

A packed row is ``[codes | scales]`` as uint8: int8 codes take one byte each, int4 codes two per byte (q + 8 in
a nibble, even element in the low nibble), then the fp32 scales' bytes. ``packed_row_bytes`` gives its length;
the estimator and the benchmarks use the same function, so their byte counts equal what the collectives move.
The functions take optional ``out`` / ``scratch`` buffers, so a caller can keep them across calls (hfzero/
quantized_comm.py pools them: [Note: quantized buffers]); without them every buffer is allocated per call.
"""

from __future__ import annotations

import torch

BITS = {"int8": 8, "int4": 4}
"""Code widths by the names ZeroConfig accepts (``quantize_weights``, ``quantize_gradients``)."""

_SCALE_BYTES = 4  # one fp32 scale per block


def levels(bits: int) -> int:
    """Largest code magnitude L: 127 for int8, 7 for int4 (symmetric, so -L..L)."""
    return (1 << (bits - 1)) - 1


def num_blocks(n: int, block: int) -> int:
    return -(-n // block)


def packed_row_bytes(n: int, bits: int, block: int) -> int:
    """Bytes of one packed row of ``n`` values: the codes of ceil(n / block) whole blocks plus their scales."""
    blocks = num_blocks(n, block)
    return blocks * (block * bits // 8 + _SCALE_BYTES)


def code_bytes(n: int, bits: int, block: int) -> int:
    """Bytes of the codes of a packed row of ``n`` values (the scales follow them)."""
    return num_blocks(n, block) * block * bits // 8


def quantize_rows(x: torch.Tensor, bits: int, block: int, out: torch.Tensor | None = None,
                  scratch: torch.Tensor | None = None) -> torch.Tensor:
    """Pack each row of ``x`` (rows, n), any float dtype, into (rows, packed_row_bytes(n)) uint8 and return it.
    See [Note: block quantization]. ``block`` must be even for int4 (two codes per byte). ``out``: the packed
    buffer to write (else allocated); ``scratch``: an fp32 (rows, num_blocks(n) x block) work buffer (else
    allocated). With both given, only the per-block scales, (rows, blocks) fp32, are allocated."""
    rows, n = x.shape
    blocks = num_blocks(n, block)
    width = blocks * block
    if out is None:
        out = torch.empty(rows, packed_row_bytes(n, bits, block), dtype=torch.uint8, device=x.device)
    padded = torch.empty(rows, width, dtype=torch.float32, device=x.device) if scratch is None else scratch
    padded[:, :n].copy_(x)
    padded[:, n:].zero_()
    values = padded.view(rows, blocks, block)  # (R, B, block)
    limit = levels(bits)
    low, high = torch.aminmax(values, dim=2)  # (R, B) each; inf / NaN propagate into the scale
    scale = torch.maximum(high, low.neg_()).div_(limit)
    safe = torch.where((scale > 0) & torch.isfinite(scale), scale, torch.ones_like(scale))
    values.div_(safe.unsqueeze(2)).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0).round_().clamp_(-limit, limit)
    size = code_bytes(n, bits, block)
    if bits == 8:
        out[:, :size].view(torch.int8).copy_(padded)
    else:
        pairs = padded.add_(8).view(rows, width // 2, 2)  # 1..15 in each nibble
        out[:, :size].copy_(pairs[:, :, 1].mul_(16).add_(pairs[:, :, 0]))  # even element in the low nibble
    out[:, size:].copy_(scale.view(torch.uint8))
    return out


def decode_rows(packed: torch.Tensor, n: int, bits: int, block: int, scratch: torch.Tensor | None = None
                ) -> torch.Tensor:
    """Decode (rows, packed_row_bytes(n)) uint8 into fp32 and return a (rows, n) view of ``scratch`` (an fp32
    (rows, num_blocks(n) x block) buffer; else allocated). Blocks whose scale is not finite decode to NaN (See
    [Note: block quantization])."""
    rows = packed.shape[0]
    blocks = num_blocks(n, block)
    width = blocks * block
    size = code_bytes(n, bits, block)
    values = torch.empty(rows, width, dtype=torch.float32, device=packed.device) if scratch is None else scratch
    payload = packed[:, :size]
    scale = packed[:, size:].contiguous().view(torch.float32).view(rows, blocks, 1)
    if bits == 8:
        values.copy_(payload.view(torch.int8))
    else:
        pairs = values.view(rows, width // 2, 2)
        pairs[:, :, 0].copy_(payload)
        pairs[:, :, 1].copy_(pairs[:, :, 0]).div_(16).floor_()  # high nibble
        pairs[:, :, 0].add_(pairs[:, :, 1], alpha=-16)  # low nibble
        values.sub_(8)
    grid = values.view(rows, blocks, block).mul_(scale)
    grid.masked_fill_(~torch.isfinite(scale), float("nan"))
    return values[:, :n]


def dequantize_rows(packed: torch.Tensor, n: int, bits: int, block: int, out: torch.Tensor,
                    scratch: torch.Tensor | None = None) -> torch.Tensor:
    """Decode (rows, packed_row_bytes(n)) uint8 into ``out`` (rows, n) of any float dtype; returns ``out``.
    ``scratch``: as in ``decode_rows``. Blocks whose scale is not finite decode to NaN."""
    out.copy_(decode_rows(packed, n, bits, block, scratch))
    return out
