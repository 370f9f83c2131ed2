"""Processes, the lowest layer: the rank grid and what ranks say to each other (imports no other layer).

Layout: the collectives take ``(batch, seq, heads, head_dim)`` tensors where they touch tokens.

    config.py     USPConfig: the parallel degrees, validated once
    groups.py     process-group teardown at exit
    gloo.py       gloo groups that run one collective at a time (a heap-corruption workaround)
    traffic.py    bytes sent and received per collective (off unless counted)
    comm.py       the Ulysses all-to-all, uneven gathers, the ring exchanger
    handshake.py  cross-rank agreement on a call before size-dependent transfers
    mesh.py       USPMesh: the DeviceMesh with axes (dp, cfg, ring, ulysses), init_usp
    replica.py    one model replica's groups, broadcast from its first rank, checksums
    logs.py       the usp_dit logger; console output from rank 0 only
"""
