"""The ``fp8_fa3`` backend: FlashAttention 3's Hopper FP8 forward (warp-specialised, FP8 tensor
cores for Q.K and P.V) on e4m3 Q, K and V, with its LSE; forward only, opt-in, never picked by ``auto``.

Layout: q (B, S, H, D), k/v (B, S, Hk, D) -> out (B, S, H, D) in q's dtype, lse (B, S, H) float32.

Note [fp8 attention, FA3]
    FA3's FP8 path takes one float32 "descale" per (batch element, K/V head) for each of Q, K and
    V (``q_descale`` / ``k_descale`` / ``v_descale``, shape (B, Hk)). Here s = max|x| / 448 over
    the element's tokens and channels of that K/V head -- for Q over the query heads that share it
    (``fp8_quant.kv_head_quant``; with H == Hk this is ``head_quant``, the ``fp8_flashinfer``
    backend's scales). The kernel folds ``s_q * s_k`` into the softmax scale, so its scores are
    ``scale * s_q * s_k * (q8 . k8)`` and the LSE it returns is the LSE of exactly these scores:
    ring blocks merge exactly, as for ``fp8_flashinfer`` (Note [fp8 attention, per head]). P is
    rounded to e4m3 inside the kernel for P.V; V's scale multiplies the output.

    The kernels come from vLLM's build of FlashAttention 3 (``vllm/vllm_flash_attn/_vllm_fa3_C``,
    registering ``torch.ops._vllm_fa3_C.fwd``): flash-attention's own ``hopper/`` wheel is built
    without FP8 where we found it (xformers' copy answers "does not support FP8"). That build is
    varlen only ("only supports varlen (for build size reasons)"), so a batch goes in as one packed
    sequence with cumulative lengths (each element attends to its own keys only: the same maths).
    It is compiled against one torch version (vLLM 0.26.0: torch 2.11, CUDA 13): loading it into
    another torch fails, and the backend then reports itself unavailable with the loader's reason.

Install (GPU machine): ``pip install vllm==0.26.0`` for torch 2.11 (any vLLM whose pinned torch is
yours), or only its FA3 library: ``bash scripts/gpu_backends/prepare_fp8_fa3.sh`` here, then
``USP_DIT_FA3_FP8_LIB=/path/_vllm_fa3_C.abi3.so`` there (scripts/gpu_backends/fp8_fa3.sh).
"""
from __future__ import annotations

import functools
import importlib.util
import os

import torch

from usp_dit.kernels.fp8_quant import head_quant, kv_head_quant
from usp_dit.kernels.protocol import BackendCaps
from usp_dit.kernels.registry import register_backend

LIB_ENV = "USP_DIT_FA3_FP8_LIB"
INSTALL = (f"pip install vllm==0.26.0 (for torch 2.11 + CUDA 13; a vLLM pinned to your torch otherwise), "
           f"or point {LIB_ENV} at its vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so (scripts/gpu_backends/prepare_fp8_fa3.sh)")


def _library_path() -> str | None:
    """``$USP_DIT_FA3_FP8_LIB``, else the installed vLLM's FA3 library (found without importing vLLM)."""
    if os.environ.get(LIB_ENV):
        return os.environ[LIB_ENV]
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "vllm_flash_attn", "_vllm_fa3_C.abi3.so")
    return path if os.path.exists(path) else None


@functools.cache
def _ops() -> tuple[object | None, str]:
    """``(torch.ops._vllm_fa3_C or None, why not)``: the library is loaded once."""
    path = _library_path()
    if path is None:
        return None, "no FA3 FP8 library found"
    try:
        torch.ops.load_library(path)
    except (OSError, RuntimeError) as err:  # built against another torch / CUDA
        return None, f"{path} does not load here ({err})"
    return torch.ops._vllm_fa3_C, ""


def varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                   descales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                   causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One FA3 forward of a batch packed as one varlen sequence. q (B, S, H, D), k/v (B, Sk, Hk, D),
    bf16/fp16 or (with ``descales``, each (B, Hk) float32) e4m3 -> out (B, S, H, D) (bf16 for e4m3
    input), lse (B, S, H) float32, natural log, scale applied."""
    b, s, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    dev = q.device
    cu_q = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=dev)
    cu_k = torch.arange(0, (b + 1) * sk, sk, dtype=torch.int32, device=dev)
    qd, kd, vd = descales if descales is not None else (None, None, None)
    out, lse, *_ = _ops()[0].fwd(
        q=q.reshape(b * s, h, d), k=k.reshape(b * sk, hk, d), v=v.reshape(b * sk, hk, v.shape[-1]),
        k_new=None, v_new=None, q_v=None, out=None, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, cu_seqlens_k_new=None,
        seqused_q=None, seqused_k=None, max_seqlen_q=s, max_seqlen_k=sk, page_table=None, kv_batch_idx=None,
        leftpad_k=None, rotary_cos=None, rotary_sin=None, seqlens_rotary=None,
        q_descale=qd, k_descale=kd, v_descale=vd, softmax_scale=scale, is_causal=causal,
        window_size_left=-1, window_size_right=-1, softcap=0.0, is_rotary_interleaved=True,
        scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0, s_aux=None,
        cp_world_size=1, cp_rank=0, cp_tot_seqused_k=None,
    )
    return out.view(b, s, h, -1), lse.reshape(h, b, s).permute(1, 2, 0).contiguous()


class FP8FA3Backend:
    name = "fp8_fa3"
    caps = BackendCaps(
        devices=frozenset({"cuda"}), dtypes=frozenset({torch.float16, torch.bfloat16}), max_head_dim=256,
        supports_backward=False, head_dims=frozenset({64, 96, 128, 192, 256}), returns_lse=True,
    )

    def available(self) -> bool:
        return (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
                and _ops()[0] is not None)

    def require(self) -> None:
        if not self.available():
            why = _ops()[1] if torch.cuda.is_available() else "no CUDA"
            raise RuntimeError(f"backend 'fp8_fa3' needs FlashAttention 3's FP8 kernels and a Hopper (SM90) GPU "
                               f"({why}): {INSTALL}")

    def forward(self, q, k, v, scale, causal=False):
        if causal:
            raise NotImplementedError("backend 'fp8_fa3' has no causal mode")
        if k.shape[1] == 0:  # no key: out 0 and lse -inf, as every backend
            return torch.zeros_like(q), q.new_full(q.shape[:3], float("-inf"), dtype=torch.float32)
        hk = k.shape[2]
        (q8, sq), (k8, sk), (v8, sv) = kv_head_quant(q, hk), head_quant(k), head_quant(v)
        out, lse = varlen_forward(q8, k8, v8, scale, descales=(sq, sk, sv))
        return out.to(q.dtype), lse


register_backend(FP8FA3Backend())
