"""Checks on the *values* of a model's inputs (masks), eager or compiled.

A value check (``bool(mask.all())``) cannot be traced: under torch.compile it breaks the graph.
``require`` keeps it in the graph instead (``torch._assert_async``): the compiled model still
refuses what the eager one refuses, as a RuntimeError carrying the same message when the graph
runs (on CUDA a device-side assert), never a silent wrong result.
"""
from __future__ import annotations

import torch


def require(cond: torch.Tensor, message: str) -> None:
    """NotImplementedError(``message``) unless ``cond`` (a one-element bool tensor) is true;
    compiled, the same check as an op of the graph (module docstring)."""
    if torch.compiler.is_compiling():
        torch._assert_async(cond, message)
    elif not bool(cond):
        raise NotImplementedError(message)
