"""Where tokens sit (above distributed/): index maths, sequence layouts, sharding and gathering tensors.

Layout: ``(batch, seq, ...)``; sequences are split on dim 1 unless a call names another.

    partition.py  shard sizes for sequences and heads over ranks (integers only)
    layouts.py    contiguous, zigzag and stripe layouts: which positions a rank holds
    shard.py      shard_sequence / gather_sequence / layout_sizes on a mesh
"""
