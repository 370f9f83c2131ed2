"""Choosing the grid for the user: exact traffic, a cost model, and the plan (``usp_dit.plan``).

Layout: no tensors; shapes are integers (batch, tokens, heads, head_dim) and figures are bytes and
milliseconds per rank.

    volumes.py    exact bytes each rank sends and receives per collective of one usp_attention call
    hardware.py   links (NVLink, PCIe, InfiniBand) and GPUs: datasheet defaults until measured
    kernels.py    attention kernel rates measured on the H200, kept as data with their source run
    models.py     what the planner knows of a model family: tokens, heads, layers, parameters, and
                  what memory needs (blocks, text encoders, VAE; counted on the meta device)
    memory.py     bytes per rank: weights by placement (replicated / sharded), text encoders
                  (replicate / shard / rank0), one call's activations, the VAE decode's share
    cost.py       one denoising step's predicted time, traffic and memory on a grid and placement
"""
