"""The attention algorithms (above sharding/ and kernels/): Ulysses x Ring with a full backward, masks, joint tokens.

Layout: ``(batch, seq, heads, head_dim)``; LSE ``(batch, heads, seq)`` in float32.

    merge.py         merging partial results by log-sum-exp
    masks.py         causal and block-causal masks as plans of kernel calls
    masked.py        one block pair under a staircase mask
    masked_joint.py  joint (text) tokens under a key mask
    ulysses.py       the all-to-all side (sequence <-> heads)
    ring.py          ring attention as an autograd Function
    usp.py           usp_attention: the one call a model sees
"""
