"""Links and GPUs the cost model prices transfers and memory on.

Layout: bandwidths in bytes per second per GPU and direction, latencies in seconds per collective
call, memory in bytes.

Note [link defaults]
    No several-GPU machine has been lent yet, so the link figures are datasheet numbers times an
    efficiency typical of NCCL's bus bandwidth, not measurements:
    - NVLink 4 (H100 / H200 SXM through NVSwitch): 450 GB/s per direction per GPU (900 GB/s
      bidirectional), x 0.8 achievable = 360 GB/s; 15 us per collective call.
    - PCIe Gen5 x16: 64 GB/s per direction, x 0.8 = 51 GB/s; 20 us.
    - InfiniBand NDR (400 Gb/s per GPU, one NIC per GPU): 50 GB/s, x 0.85 = 42.5 GB/s; 25 us.
    A node holds 8 GPUs. With "infiniband", groups that fit in one node (the mesh's inner axes
    first: Ulysses, then ring, then cfg) use NVLink and groups that span nodes use InfiniBand.
    ``plan(..., link=Link(...))`` overrides them; the first several-GPU run calibrates them
    (``benchmarks/bench_scaling.py`` prints the prediction beside each measurement).
"""
from __future__ import annotations

from dataclasses import dataclass

GB = 1e9
GPUS_PER_NODE = 8


@dataclass(frozen=True)
class Link:
    """One kind of link: sustained bandwidth per GPU and direction, and latency per collective."""

    name: str
    bandwidth: float  # bytes / s
    latency: float  # s per collective call

    def seconds(self, nbytes: float, calls: int = 1) -> float:
        """Time to move ``nbytes`` each way in ``calls`` collective calls."""
        return nbytes / self.bandwidth + calls * self.latency if nbytes else 0.0


LINKS = {
    "nvlink": Link("nvlink", 450 * GB * 0.8, 15e-6),
    "pcie": Link("pcie", 64 * GB * 0.8, 20e-6),
    "infiniband": Link("infiniband", 50 * GB * 0.85, 25e-6),
}
INTERCONNECTS = tuple(LINKS)


@dataclass(frozen=True)
class GPU:
    """A GPU: its memory, its dense bf16 GEMM rate, and the memory bandwidth merges run at."""

    name: str
    memory: float  # bytes
    gemm_flops: float  # sustained bf16 GEMM flop/s (projections, MLPs)
    memory_bandwidth: float  # bytes / s


# H200 figures measured here (shared/shapes.md: 780 TF/s bf16 GEMM 8192^3; the copy bandwidth is
# the datasheet's 4.8 TB/s x 0.85); H100 SXM the same chip with 80 GB at 3.35 TB/s (datasheet).
GPU_TABLE = {
    "h200": GPU("h200", 141 * GB, 780e12, 4.8e12 * 0.85),
    "h100": GPU("h100", 80 * GB, 780e12, 3.35e12 * 0.85),
}


def check_interconnect(interconnect: str) -> str:
    if interconnect not in LINKS:
        raise ValueError(f"interconnect={interconnect!r} is not known; choose one of {list(INTERCONNECTS)}")
    return interconnect


def check_gpu(gpu: str | None) -> GPU:
    name = "h200" if gpu is None else str(gpu).lower()
    if name not in GPU_TABLE:
        raise ValueError(f"gpu={gpu!r} is not known; choose one of {sorted(GPU_TABLE)} (or None: h200)")
    return GPU_TABLE[name]


def group_link(interconnect: str, span: int) -> Link:
    """The link a group of ranks whose consecutive global ranks span ``span`` GPUs uses: NVLink
    inside a node, the interconnect across nodes (Note [link defaults])."""
    if interconnect == "infiniband" and span <= GPUS_PER_NODE:
        return LINKS["nvlink"]
    return LINKS[interconnect]
