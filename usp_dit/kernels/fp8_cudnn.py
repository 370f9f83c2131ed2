"""The ``fp8_cudnn`` backend: cuDNN's fused FP8 flash-attention forward (``sdpa_fp8`` of the cuDNN
graph API, through the ``cudnn`` Python frontend) on e4m3 Q, K and V, with its LSE; forward only,
opt-in, never picked by ``auto``.

Layout: q (B, S, H, D), k/v (B, S, Hk, D) -> out (B, S, H, D) in q's dtype, lse (B, S, H) float32.

Note [fp8 attention, cuDNN]
    cuDNN's FP8 attention takes one float32 descale per tensor for each of Q, K and V (shape
    (1, 1, 1, 1)): here s = max|x| / 448 over the whole tensor (``fp8_quant.tensor_quant``; on the
    GPU the same values in two passes, ``_quant_triton``). Its scores are ``scale * s_q * s_k *
    (q8 . k8)`` in float32, and the softmax statistics it returns (``generate_stats``: max + log of
    the sum of exponentials, natural log) are the LSE of exactly these scores, so ring blocks merge
    exactly, as for the other FP8 backends (Note [fp8 attention, per head]). P is multiplied by
    ``scale_s`` = 448 and rounded to e4m3 for P.V (P lies in (0, 1] after the running max is
    subtracted, so 1 maps to e4m3's largest value), and ``descale_s`` = 1/448 undoes it; V's
    descale multiplies the output.

    On Hopper cuDNN writes the output in FP8 only (bf16 / fp16 output is Blackwell's, cuDNN >=
    9.13): it is written in e4m3 with ``scale_o`` = 1 / (9/8 s_v), i.e. in units of V's own step,
    which always fits: an output row is a convex combination of V's rows, |out| <= max|V| = 448 s_v,
    except that P's e4m3 rounding may lift the weights' sum by up to 2^-4, inside the 9/8 headroom
    (an e4m3 value past 448 would be NaN). It is multiplied back by 9/8 s_v in q's dtype. That
    rounding adds e4m3's relative error (at most 2^-4, half a step) to the output, not to the LSE:
    the merge of ring blocks stays exact to what the blocks computed. (Blackwell could write the
    output in q's dtype; the backend runs on Hopper only, the GPU it was measured on.) A
    tensor-wide scale is coarser than ``fp8_flashinfer``'s per-head ones: only values below about
    2^-15 of the tensor's largest lose relative precision (e4m3 keeps 3 mantissa bits down to 2^-6
    of its 448, subnormals below), which for a head 100x quieter than the loudest still leaves its
    values normal. The error is measured beside the other backends' (docs/FP8.md).

    One graph is built per shape (batch, heads, lengths, head dims, scale) and kept: a ring
    step calls the same few shapes every layer. Graph building raises the frontend's
    ``cudnnGraphNotSupportedError`` for a shape this cuDNN cannot run; that becomes a
    ``NotImplementedError`` naming the shape and cuDNN's reason.

Note [fp8 attention, cuDNN, long calls]
    The output's error grows with the keys of one call, unlike ``fp8_fa3``'s (measured on an
    H100, 2026-12-07, DiT-like inputs against bf16 SDPA; benchmarks/diag_fp8_length.py): relative
    L1 4-5e-2 at 3-5k keys (against float64), 8.7e-2 at 16 385, 0.26 at 118 877 (cosine 0.991), where
    ``fp8_fa3`` has 1.7e-2 and 8.2e-3. A float64 model of our quantisation alone
    (benchmarks/model_fp8_cudnn.py) stays at relative L1 2.8e-2 from 30 001 to 118 877 keys
    (4.2e-2 at 3 001, as the GPU measures there); a large L1 beside a high cosine suggests a
    shrinking magnitude, a bias that builds up over the ~930 key blocks inside cuDNN's kernel (the
    FP8 tensor cores' limited accumulation of P.V is the suspect; not confirmed). Splitting the
    keys into chunks of 16 384 merged by LSE brings it to 8.4e-2 at 6% more time. So a call with
    more than ``LONG_CALL`` keys warns once per key count; ``fp8_fa3`` is the accurate FP8 path
    there (``fp8_flashinfer`` was not measured at these lengths).

Install (GPU machine): ``pip install nvidia-cudnn-frontend`` (a 2 MB wheel; it loads the libcudnn
that torch brings). No build step, no JIT. Needs cuDNN >= 9 and a Hopper (SM90) GPU (measured
with frontend 1.18.0 on cuDNN 9.19).
"""
from __future__ import annotations

import functools
import warnings

import torch

from usp_dit.kernels.fp8_quant import E4M3_MAX, tensor_quant
from usp_dit.kernels.protocol import BackendCaps, import_optional
from usp_dit.kernels.registry import register_backend

INSTALL = "pip install nvidia-cudnn-frontend"
HEADROOM = 1.125  # of the e4m3 output over max|V| (Note [fp8 attention, cuDNN])
LONG_CALL = 8192  # keys in one call past which the error grows (Note [fp8 attention, cuDNN, long calls])
# uids of the graph's tensors (any distinct integers: they key the variant pack)
Q, K, V, O, STATS, DQ, DK, DV, DS, SS, SO, AMAX_S, AMAX_O = range(13)


@functools.cache
def _frontend() -> tuple[object | None, str]:
    """``(the cudnn module or None, why not)``: imported once."""
    try:
        import cudnn
    except ImportError as err:  # not installed, or built for another Python
        return None, f"the cudnn frontend does not import ({err})"
    try:
        version = cudnn.backend_version()
    except Exception as err:  # libcudnn not found by the frontend  # noqa: BLE001
        return None, f"the cudnn frontend finds no libcudnn ({err})"
    if version < 90000:
        return None, f"cuDNN {version} is older than 9.0"
    return cudnn, ""


@functools.cache
def _triton_module():
    """``usp_dit.kernels._quant_triton`` (the quantisation in two passes, the output's conversion in
    one), or ``None`` without Triton."""
    return import_optional("usp_dit.kernels._quant_triton") if import_optional("triton") is not None else None


def _fused_quant():
    """Triton's quantisation, else PyTorch's (``fp8_quant.tensor_quant``: the same values, more passes)."""
    module = _triton_module()
    return tensor_quant if module is None else module.tensor_quant


def _dequant():
    """e4m3 output -> ``dtype``: Triton's one pass (``_quant_triton.dequant``), else PyTorch's."""
    module = _triton_module()
    return (lambda x8, s, dtype: (x8.float() * s).to(dtype)) if module is None else module.dequant


@functools.cache
def _handle(device: int) -> int:
    """One cuDNN handle per device (created on that device)."""
    with torch.cuda.device(device):
        return _frontend()[0].create_handle()


@functools.cache
def _graph(device: int, b: int, h: int, hk: int, s: int, sk: int, d: int, dv: int,
           scale: float) -> tuple[object, int]:
    """The built graph of one shape and its workspace size in bytes; e4m3 in and out (Note [fp8
    attention, cuDNN])."""
    cudnn = _frontend()[0]
    f32, e4m3 = cudnn.data_type.FLOAT, cudnn.data_type.FP8_E4M3
    g = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32,
                      handle=_handle(device))

    def bshd(uid: int, heads: int, length: int, dim: int):  # (B, S, H, D) memory seen as (b, h, s, d)
        return g.tensor(uid=uid, dim=(b, heads, length, dim), stride=(length * heads * dim, dim, heads * dim, 1),
                        data_type=e4m3)

    def scalar(uid: int):
        return g.tensor(uid=uid, dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=f32)

    q, k, v = bshd(Q, h, s, d), bshd(K, hk, sk, d), bshd(V, hk, sk, dv)
    o, stats, amax_s, amax_o = g.sdpa_fp8(
        q=q, k=k, v=v, descale_q=scalar(DQ), descale_k=scalar(DK), descale_v=scalar(DV),
        descale_s=scalar(DS), scale_s=scalar(SS), scale_o=scalar(SO), generate_stats=True, attn_scale=scale,
    )
    o.set_uid(O).set_output(True).set_dim((b, h, s, dv)).set_stride((s * h * dv, dv, h * dv, 1))
    o.set_data_type(e4m3)
    stats.set_uid(STATS).set_output(True).set_dim((b, h, s, 1)).set_stride((h * s, s, 1, 1)).set_data_type(f32)
    for t, uid in ((amax_s, AMAX_S), (amax_o, AMAX_O)):
        t.set_uid(uid).set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(f32)
    try:
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
    except Exception as err:  # cudnnGraphNotSupportedError and cuDNN's own errors  # noqa: BLE001
        raise NotImplementedError(
            f"backend 'fp8_cudnn': cuDNN cannot run q {(b, s, h, d)}, k {(b, sk, hk, d)}, v head_dim {dv} "
            f"in FP8 ({type(err).__name__}: {err})"
        ) from err
    return g, g.get_workspace_size()


@functools.cache
def _constants(device: torch.device) -> dict[int, torch.Tensor]:
    """The fixed scales of P and the amax outputs (written by the kernel, never read)."""
    def one(x: float) -> torch.Tensor:
        return torch.full((1, 1, 1, 1), x, dtype=torch.float32, device=device)

    return {SS: one(E4M3_MAX), DS: one(1.0 / E4M3_MAX), AMAX_S: one(0.0), AMAX_O: one(0.0)}


def quantised_forward(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor,
                      descales: tuple[torch.Tensor, torch.Tensor, torch.Tensor], scale: float,
                      dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One cuDNN FP8 forward. q8 (B, S, H, D), k8/v8 (B, Sk, Hk, D) e4m3 contiguous, ``descales``
    three float32 scalars -> out (B, S, H, Dv) in ``dtype``, lse (B, S, H) float32 (natural log)."""
    cudnn = _frontend()[0]
    b, s, h, d = q8.shape
    sk, hk, dv = k8.shape[1], k8.shape[2], v8.shape[3]
    dev = q8.device
    graph, ws = _graph(dev.index, b, h, hk, s, sk, d, dv, float(scale))
    out8 = torch.empty((b, s, h, dv), dtype=torch.float8_e4m3fn, device=dev)
    stats = torch.empty((b, h, s, 1), dtype=torch.float32, device=dev)
    workspace = torch.empty(max(ws, 1), dtype=torch.uint8, device=dev)
    sv = descales[2].reshape(1, 1, 1, 1)
    # the e4m3 output in units of V's step, with headroom (Note [fp8 attention, cuDNN])
    pack = {Q: q8, K: k8, V: v8, O: out8, STATS: stats, SO: (sv * HEADROOM).reciprocal(), **_constants(dev)}
    pack.update({DQ: descales[0].reshape(1, 1, 1, 1), DK: descales[1].reshape(1, 1, 1, 1), DV: sv})
    handle = _handle(dev.index)
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(dev).cuda_stream)
    graph.execute(pack, workspace, handle=handle)
    out = _dequant()(out8, descales[2] * HEADROOM, dtype)
    return out, stats.view(b, h, s).transpose(1, 2).contiguous()


@functools.cache
def _warn_long_call(keys: int) -> None:
    """Once per key count (Note [fp8 attention, cuDNN, long calls])."""
    warnings.warn(f"backend 'fp8_cudnn' on {keys} keys in one call: its error grows with the keys of a "
                  f"call (relative L1 0.26 at 118 877 keys on an H100, against fp8_fa3's 8e-3); prefer "
                  f"'fp8_fa3' for long calls, or more ring ranks (docs/FP8.md)", stacklevel=3)


class FP8CudnnBackend:
    name = "fp8_cudnn"
    caps = BackendCaps(
        devices=frozenset({"cuda"}), dtypes=frozenset({torch.float16, torch.bfloat16}), max_head_dim=128,
        supports_backward=False, head_dims=frozenset({64, 128}), returns_lse=True,
    )

    def available(self) -> bool:
        return (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
                and _frontend()[0] is not None)

    def require(self) -> None:
        if not self.available():
            why = _frontend()[1] if torch.cuda.is_available() else "no CUDA"
            raise RuntimeError(f"backend 'fp8_cudnn' needs the cudnn Python frontend, cuDNN >= 9 and a Hopper "
                               f"(SM90) GPU ({why or 'not an SM90 GPU'}): {INSTALL}")

    def forward(self, q, k, v, scale, causal=False):
        if causal:
            raise NotImplementedError("backend 'fp8_cudnn' has no causal mode")
        if k.shape[1] == 0:  # no key: out 0 and lse -inf, as every backend
            return torch.zeros_like(q), q.new_full(q.shape[:3], float("-inf"), dtype=torch.float32)
        if k.shape[1] > LONG_CALL:
            _warn_long_call(k.shape[1])
        quant = _fused_quant()
        (q8, sq), (k8, sk), (v8, sv) = quant(q), quant(k), quant(v)
        return quantised_forward(q8.contiguous(), k8.contiguous(), v8.contiguous(), (sq, sk, sv), scale, q.dtype)


register_backend(FP8CudnnBackend())
