"""Sequence-parallel attention for any transformer, and causal-LM fine-tuning on a sharded sequence.

Layout: attention inputs (batch, seq_local, heads, head_dim) (``USPAttention``); token tensors
(batch, seq_local) (``shard_lm_batch``); logits (batch, seq_local, vocab) (``lm_loss``).

    usp_dit.llm.attention  USPAttention: usp_attention as a module, to drop into any model
    usp_dit.llm.hf         register_transformers: attn_implementation="usp" for Hugging Face models
    usp_dit.llm.train      shard_lm_batch, lm_loss, sync_lm_grads: a loss equal to one process's

``import usp_dit`` loads ``USPAttention`` only (it needs the core alone); the other names load their
module on first access, and transformers itself is imported only when ``register_transformers`` is
called. The recipe, end to end: docs/LLM.md and examples/finetune_llm.py.
"""
from __future__ import annotations

import importlib
from typing import Any

from usp_dit.llm.attention import USPAttention

_LAZY = {
    "register_transformers": "usp_dit.llm.hf",
    "IGNORE_INDEX": "usp_dit.llm.train", "LMBatch": "usp_dit.llm.train", "lm_loss": "usp_dit.llm.train",
    "shard_lm_batch": "usp_dit.llm.train", "shift_labels": "usp_dit.llm.train", "sync_lm_grads": "usp_dit.llm.train",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'usp_dit.llm' has no attribute {name!r}")


__all__ = [
    "IGNORE_INDEX",
    "LMBatch",
    "USPAttention",
    "lm_loss",
    "register_transformers",
    "shard_lm_batch",
    "shift_labels",
    "sync_lm_grads",
]
