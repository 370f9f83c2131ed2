"""Host (Python + launch) time of one attention call on the GPU, at PixArt's shape: stock's
``F.scaled_dot_product_attention`` against the aten ops (binding and ``torch.ops``) and
``one_rank_attention``, the call a routed one-rank processor makes.

    PYTHONPATH=. python3 benchmarks/bench_call_host.py

"host": a burst of 20 launches timed without a sync (short enough that the GPU queue does not
throttle the host), best of 5; "device-bound": 200 calls between syncs (the kernel's time).
Layout: q/k/v (B, S, H, D) for one_rank_attention, their (B, H, S, D) views for the aten ops.
"""
import torch, time
import torch.nn.functional as F
from usp_dit.attention.usp import one_rank_attention
d = torch.device("cuda")
q = torch.randn(1, 4096, 16, 72, device=d, dtype=torch.bfloat16)
k = torch.randn_like(q); v = torch.randn_like(q)
qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
print("fused choice", torch._fused_sdp_choice(qt, kt, vt))
def host(f, n=200):
    for _ in range(20): f()
    torch.cuda.synchronize()
    best = 1e9
    for _ in range(5):
        # launch-only: a short burst so the GPU queue does not throttle the host
        s = time.perf_counter()
        for _ in range(n): f()
        e = time.perf_counter()
        torch.cuda.synchronize()
        best = min(best, (e - s) / n * 1e6)
    return best
with torch.inference_mode():
    fs = {
        "F.sdpa": lambda: F.scaled_dot_product_attention(qt, kt, vt),
        "binding cudnn": lambda: torch._scaled_dot_product_cudnn_attention(qt, kt, vt, None, False, 0.0, False, False, scale=72**-0.5),
        "ops cudnn": lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(qt, kt, vt, None, False, 0.0, False, False, scale=72**-0.5),
        "binding flash": lambda: torch._scaled_dot_product_flash_attention(qt, kt, vt, 0.0, False, False, scale=72**-0.5),
        "one_rank_attention": lambda: one_rank_attention(q, k, v),
    }
    for name, f in fs.items():
        print(f"{name:20s} host {host(f, 20):7.1f} us a call (launch burst of 20)")
    for name, f in fs.items():
        torch.cuda.synchronize(); s = time.perf_counter()
        for _ in range(200): f()
        torch.cuda.synchronize(); print(f"{name:20s} device-bound {(time.perf_counter()-s)/200*1e6:7.1f} us a call")
