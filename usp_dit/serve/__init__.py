"""The server (the top layer): a warm pipeline on a USP grid behind an OpenAI-compatible HTTP API.

    torchrun --standalone --nproc-per-node 4 -m usp_dit.serve --family wan --ulysses 2 --ring 2

docs/SERVING.md has the quick start, the API, the flags and what happens on a fault. Modules:
``server`` (the command line and the ranks' loops), ``control`` (the control plane: broadcast,
agreement, heartbeat), ``worker`` (one batch on every rank), ``jobs`` (rank 0's queue and
batching), ``app`` (FastAPI), ``protocol`` (request checks), ``families``, ``encode``, ``metrics``.
Nothing else of usp_dit imports this package: FastAPI, uvicorn and prometheus-client are needed
only here (``pip install 'usp-dit[serve]'``).
"""
