"""The FP8 wire format of the Ulysses exchanges (``comm_dtype="fp8"``): lossy, opt-in, forward only.

Layout: a tensor ``(batch, seq, heads, head_dim)`` of any float dtype travels as
``(batch, seq, heads, head_dim + 4)`` uint8: each (token, head) row's ``head_dim`` values in
float8 e4m3 (``torch.float8_e4m3fn``), then that row's float32 scale as 4 bytes. One buffer, so an
exchange stays ONE all-to-all and the traffic counter sees the bytes that really travel.

Note [fp8 wire]
    Scale: s = max|x_row| / 448 (448 is e4m3's largest finite value), s = 1 for an all-zero row;
    sent: e4m3(clamp(x / s, -448, 448)) and s. Received: e4m3 value * s, in float32 (float64 for
    float64 tensors), then the tensor's dtype. One scale per (token, head) row, never per block or
    per rank: what a row becomes depends on that row alone, so the result of a call does not
    depend on the grid (the same rows are encoded whatever the shards), and one process can
    reproduce it exactly with ``roundtrip`` (tests/test_fp8_comm.py does).

    Error of one value: e4m3 keeps 3 mantissa bits, so in its normal range (|x| / s >= 2^-6)
    rounding to nearest moves a value by at most 2^-4 of itself; below that the step is fixed,
    2^-9 in scaled units, so a value moves by at most 2^-10 s. Bound: |x - x'| <= 2^-4 |x| +
    2^-10 s (``error_bound``), plus the rounding of the result to the tensor's dtype. Values more
    than 2^6 x 448 (~28 700) times smaller than their row's largest keep only that absolute
    accuracy: heavy-tailed rows (one huge channel) lose their small values first, the case the
    quality gate measures (docs/FP8.md).

    Which tensors: Q, V and the attention output (and nothing that carries a gradient: a call
    that needs gradients is refused). K keeps the model's dtype: an error in K moves every score
    of a row through the softmax's exponent, where Q's error is spread over D products the same
    way but V's and the output's are not exponentiated at all; K is the tensor issue 32 asked to
    keep until measured safe (docs/FP8.md has the measurement). The LSE and the joint (text)
    tokens' gathers keep their dtype too; the ring's V blocks travel as wire rows (Note [fp8 ring V]).

Note [fp8 ring V]
    With ``comm_dtype="fp8"`` and a ring (R > 1), V's wire rows are what travels around the ring:
    each rank encodes its V rows once -- or, with U > 1, keeps the very bytes its Ulysses exchange
    received (``scatter_heads_encoded``) -- decodes them for its own block, and passes the bytes
    on; every other rank decodes the same bytes. So every V row is encoded exactly once on every
    grid with U > 1 or R > 1 (never twice: re-encoding a decoded row could move it by an ulp of
    its dtype), and the ring adds no rounding of its own: on (U, R) every V row has the bits it
    has on (U, 1), ``roundtrip(v)``, and a pure ring (1, R) computes attention of the exact Q and
    K with ``roundtrip(V)`` (Q and the output cross no Ulysses exchange there). K keeps the
    model's dtype (why: Note [fp8 wire]). A stream step's block is one buffer of K's bytes and V's
    wire row (``pack_kv``: D e + D + 4 bytes a (token, head) instead of 2 D e, 0.76x at bf16);
    the gather schedules all-gather K and the wire rows, each padded as before (padding rows
    decode to zeros). Forward only, as the Ulysses exchange.
"""
from __future__ import annotations

import torch

COMM_DTYPES = ("model", "fp8")
E4M3_MAX = 448.0
SCALE_BYTES = 4  # one float32 scale per (token, head) row
# The bound of one value's error (Note [fp8 wire]): |x - roundtrip(x)| <= REL * |x| + ABS * s,
# s = max|x_row| / 448: REL is half of e4m3's relative step in its normal range, ABS half of its
# subnormal step (2^-9, in scaled units).
ERROR_REL = 2.0 ** -4
ERROR_ABS = 2.0 ** -10


def check_comm_dtype(name: str) -> str:
    """``name`` if it is one of ``COMM_DTYPES``; ValueError naming the argument otherwise."""
    if name not in COMM_DTYPES:
        raise ValueError(f"comm_dtype={name!r}; use one of {list(COMM_DTYPES)}")
    return name


def wire_row_bytes(head_dim: int) -> int:
    """Bytes of one (token, head) row on the wire: ``head_dim`` e4m3 values and the scale."""
    return head_dim + SCALE_BYTES


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def row_scales(x: torch.Tensor) -> torch.Tensor:
    """``(..., 1)`` float32: each row's scale (Note [fp8 wire])."""
    amax = x.to(_work_dtype(x.dtype)).abs().amax(dim=-1, keepdim=True)
    scale = (amax / E4M3_MAX).to(torch.float32)
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def encode(x: torch.Tensor) -> torch.Tensor:
    """``(..., D)`` float -> ``(..., D + 4)`` uint8 (Note [fp8 wire])."""
    work = x.to(_work_dtype(x.dtype))
    scale = row_scales(x)
    # The float32 scale may round below max|x| / 448: clamp, as e4m3fn has no infinity to absorb it.
    values = (work / scale.to(work.dtype)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return torch.cat([values.view(torch.uint8), scale.view(torch.uint8)], dim=-1)


def decode(wire: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(..., D + 4)`` uint8 -> ``(..., D)`` of ``dtype``: the inverse of ``encode`` up to e4m3 rounding."""
    d = wire.shape[-1] - SCALE_BYTES
    work = _work_dtype(dtype)
    values = wire[..., :d].contiguous().view(torch.float8_e4m3fn).to(work)
    scale = wire[..., d:].contiguous().view(torch.float32).to(work)
    return (values * scale).to(dtype)


def pack_kv(k: torch.Tensor, v_wire: torch.Tensor) -> torch.Tensor:
    """K (B, L, Hk, D) of any float dtype and V's wire rows (B, L, Hk, D + 4) -> one uint8 buffer
    (B, L, Hk, D e + D + 4): a ring block as it travels (Note [fp8 ring V])."""
    return torch.cat([k.contiguous().view(torch.uint8), v_wire], dim=-1)


def unpack_kv(buf: torch.Tensor, dtype: torch.dtype, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``pack_kv``: ``(k, v)`` (B, L, Hk, D) of ``dtype``, V decoded."""
    k_bytes = head_dim * dtype.itemsize
    return buf[..., :k_bytes].contiguous().view(dtype), decode(buf[..., k_bytes:], dtype)


def roundtrip(x: torch.Tensor) -> torch.Tensor:
    """What ``x`` becomes after one FP8 exchange (no communication): the reference of the tests
    and the quality gate."""
    return decode(encode(x), x.dtype)


def error_bound(x: torch.Tensor) -> torch.Tensor:
    """Elementwise bound of ``|x - roundtrip(x)|`` (Note [fp8 wire]), in ``x``'s work dtype."""
    work = x.to(_work_dtype(x.dtype))
    return ERROR_REL * work.abs() + ERROR_ABS * row_scales(x).to(work.dtype)
