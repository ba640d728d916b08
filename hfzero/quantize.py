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
Nothing here is resident: every buffer is transient, allocated per call.
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


def quantize_rows(x: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """Pack each row of ``x`` (rows, n), any float dtype, into (rows, packed_row_bytes(n)) uint8. See
    [Note: block quantization]. ``block`` must be even for int4 (two codes per byte)."""
    rows, n = x.shape
    blocks = num_blocks(n, block)
    padded = torch.zeros(rows, blocks * block, dtype=torch.float32, device=x.device)
    padded[:, :n] = x
    values = padded.view(rows, blocks, block)  # (R, B, block)
    limit = levels(bits)
    scale = values.abs().amax(dim=2) / limit  # (R, B); inf / NaN propagate into the scale
    safe = torch.where((scale > 0) & torch.isfinite(scale), scale, torch.ones_like(scale))
    codes = torch.nan_to_num(values / safe.unsqueeze(2), nan=0.0, posinf=0.0, neginf=0.0)
    codes = codes.round_().clamp_(-limit, limit).to(torch.int8).view(rows, blocks * block)
    if bits == 8:
        payload = codes.view(torch.uint8)
    else:
        nibbles = (codes + 8).to(torch.uint8).view(rows, -1, 2)  # 1..15 in each nibble
        payload = nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)
    return torch.cat([payload, scale.contiguous().view(torch.uint8)], dim=1)


def dequantize_rows(packed: torch.Tensor, n: int, bits: int, block: int, out: torch.Tensor) -> torch.Tensor:
    """Decode (rows, packed_row_bytes(n)) uint8 into ``out`` (rows, n) of any float dtype; returns ``out``.
    Blocks whose scale is not finite decode to NaN (See [Note: block quantization])."""
    rows = packed.shape[0]
    blocks = num_blocks(n, block)
    code_bytes = blocks * block * bits // 8
    payload = packed[:, :code_bytes]
    scale = packed[:, code_bytes:].contiguous().view(torch.float32).view(rows, blocks, 1)
    if bits == 8:
        codes = payload.contiguous().view(torch.int8).to(torch.float32)
    else:
        low = (payload & 0x0F).to(torch.float32) - 8
        high = (payload >> 4).to(torch.float32) - 8
        codes = torch.stack([low, high], dim=2)  # (R, blocks * block / 2, 2)
    values = codes.view(rows, blocks, block) * scale
    values = torch.where(torch.isfinite(scale), values, torch.full_like(values, float("nan")))
    out.copy_(values.view(rows, blocks * block)[:, :n])
    return out
