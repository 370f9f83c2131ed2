"""Prometheus metrics of the server (``GET /metrics``), in a registry of their own.

Layout: no tensors.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
STEP_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_depth = Gauge("usp_dit_queue_depth", "Requests waiting in the queue", registry=r)
        self.running = Gauge("usp_dit_running_requests", "Requests in the batch the ranks are running", registry=r)
        self.latency = Histogram("usp_dit_request_latency_seconds", "From arrival to answer, by kind",
                                 ["kind"], buckets=LATENCY_BUCKETS, registry=r)
        self.step_time = Histogram("usp_dit_step_seconds", "Wall time of one denoising step (rank 0)",
                                   buckets=STEP_BUCKETS, registry=r)
        self.batch_time = Histogram("usp_dit_batch_seconds", "Wall time of a batch's pipeline call on rank 0 "
                                    "(control plane included)", buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("usp_dit_batch_images", "Images or videos per batch",
                                    buckets=(1, 2, 4, 8, 16, 32), registry=r)
        self.requests = Counter("usp_dit_requests", "Answered requests, by kind and HTTP status",
                                ["kind", "status"], registry=r)
        self.failures = Counter("usp_dit_failures", "Failures: pipeline (a batch raised), rank (fatal), "
                                "rejected (bad input), full (429)", ["reason"], registry=r)
        self.ready = Gauge("usp_dit_ready", "1 once warmed up and serving", registry=r)
        # Read at each scrape, rank 0's GPU only (a failed request must leave nothing held: issue 31).
        self.gpu_memory = Gauge("usp_dit_gpu_memory_bytes", "Rank 0's CUDA memory now: allocated by tensors, "
                                "reserved by the caching allocator", ["kind"], registry=r)

    def read_gpu_memory(self) -> None:
        """Set ``usp_dit_gpu_memory_bytes`` from rank 0's current CUDA device (nothing without CUDA)."""
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.gpu_memory.labels("allocated").set(torch.cuda.memory_allocated())
            self.gpu_memory.labels("reserved").set(torch.cuda.memory_reserved())

    def render(self) -> bytes:
        return generate_latest(self.registry)
