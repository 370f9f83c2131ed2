"""Tensor parallelism for a DiT's blocks: heads and MLP columns over the "tensor" axis, undone exactly.

Layout: activations (batch, seq_local, channels) enter and leave every block whole on each tensor
rank (the tensor ranks hold the same tokens: Note [the tensor axis] in usp_dit.distributed.mesh);
inside, a column-parallel projection gives (batch, seq_local, heads_local * head_dim) and the
attention sees Q/K/V (batch, seq_local, heads_local, head_dim); a row-parallel projection sums the
tensor ranks' partial outputs (an all-reduce) back to (batch, seq_local, channels). Weights are
DTensors on the tensor group's DeviceMesh: column-parallel ``Shard(0)``, row-parallel ``Shard(1)``
(their bias ``Replicate``), through ``torch.distributed.tensor.parallel.parallelize_module``.

Note [tensor plans]
    A family declares where its blocks can be cut (``TensorPlan``), in the manner of Diffusers'
    ``_tp_plan``: per block list, the ``Split`` s of an inner dimension (an attention's heads x
    head_dim, or an MLP's hidden width), each with the Linears that produce it (column-parallel)
    and those that consume it alone (row-parallel), and the ``Concat`` s: a row-parallel Linear fed
    the concatenation of several splits (Flux's single blocks: ``proj_out(cat[attention, MLP])``),
    and the ``Fused`` s: a column-parallel Linear whose output is the concatenation of several
    splits (Flux.2's single blocks: ``to_qkv_mlp_proj`` makes [q, k, v | MLP gate, value], the heads'
    split in 3 packs and the MLP width's in 2). A processor that chunks such an output by sizes it
    reads from its module (``attn.inner_dim``, ``attn.mlp_hidden_dim``) sees them as a tensor rank's
    own while cut (``Split.width``), and as they were after ``remove``. Everything else (norms,
    modulation, embedders, ``proj_out`` of the model) stays whole on every rank. Only what is exact is declared: a norm over all heads at once (Wan's
    ``rms_norm_across_heads``) would see a tensor rank's heads alone, so such a family has no plan
    and refuses ``tensor_degree > 1`` by name.

Note [per-head weights under tensor parallelism]
    An attention's own weights that act on every head alike (RMSNorm over head_dim on Q and K)
    stay whole on each tensor rank but see only that rank's heads: the forward is exact, and each
    rank's gradient of them is the sum over its heads alone. A gradient hook all-reduces it over
    the tensor group, so every tensor rank holds the whole gradient, as one process would. The
    other whole weights (modulation, embedders, norms outside the cut) see every channel on every
    tensor rank already: their gradients are whole and equal there.

Note [uneven tensor splits]
    Any head count: a split of ``n`` units (heads, or MLP columns) over T ranks is padded to
    ``ceil(n / T) * T`` units with zero weights, so each rank takes the same whole number of heads
    and DTensor's even ``Shard`` holds. The padding is exact, not approximate: a padded unit's
    column-parallel rows and bias are zero, and the row-parallel columns that read it are zero, so
    whatever it computes (softmax of zero scores over zero values; act(0)) is multiplied by zero
    before the all-reduce. Its gradients are zero too (its output is read by zero weights, its
    weights by a zero output), so training leaves it zero. The cost is the padded work (30 heads on
    T = 4: 32 computed, 6 %).

    Packed layouts (a GEGLU/SwiGLU projection whose output is [gate, value]; a concat input; a
    fused projection's [q, k, v | gate, value]) are laid out rank-major before sharding: rank r's
    rows are [pack 0's r-th slice, pack 1's, ...] (each part padded on its own), so a plain
    ``Shard`` gives each rank the pieces its forward chunks or concatenates (x_r: rank r's slice of x):

        fused rows   [ q_0 k_0 v_0 g_0 u_0 | q_1 k_1 v_1 g_1 u_1 | ... ]

    Every parameter keeps the index map of its rows (columns) to the original ones; ``remove`` gathers
    the full tensor (``full_tensor``) and puts each row back, dropping the padding, so
    ``disable_usp`` leaves the very tensors it found (bit for bit).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

import usp_dit.distributed.traffic as traffic
from usp_dit.distributed.mesh import USPMesh


@dataclass(frozen=True)
class Split:
    """One inner dimension of a block, cut over the tensor ranks (Note [tensor plans]).

    ``columns``: Linears (paths inside the block) whose output is ``packs`` equal parts of this
    dimension (2 for a gated MLP's [gate, value]); ``rows``: Linears whose input is this dimension
    alone; ``heads``: the attention module whose heads make the dimension (heads x head_dim: whole
    heads are cut, and its ``heads`` attribute becomes the local count), or None for an MLP width;
    ``width``: an int attribute (path inside the block, ``"attn.mlp_hidden_dim"``) holding the
    dimension's size, for a split made only by a ``Fused`` projection (no ``columns`` of its own to
    read it from), set to a tensor rank's local size while cut (a processor splits by it).
    """

    columns: tuple[str, ...]
    rows: tuple[str, ...] = ()
    heads: str | None = None
    packs: int = 1
    width: str | None = None


@dataclass(frozen=True)
class Fused:
    """A column-parallel Linear whose output is the concatenation of ``splits`` (indices into the
    block's splits, in the order of its output), each in its own ``packs`` parts: Flux.2's
    ``to_qkv_mlp_proj`` = [q, k, v | gate, value] is ``Fused(path, (heads, mlp))``."""

    column: str
    splits: tuple[int, ...]


@dataclass(frozen=True)
class Concat:
    """A row-parallel Linear whose input is the concatenation of ``splits`` (indices into the block's
    splits, in the order the forward concatenates their outputs)."""

    row: str
    splits: tuple[int, ...]


@dataclass(frozen=True)
class BlockCuts:
    """The cuts of every block of one block list."""

    block_list: str
    splits: tuple[Split, ...]
    concats: tuple[Concat, ...] = ()
    fused: tuple[Fused, ...] = ()


@dataclass(frozen=True)
class TensorPlan:
    """Where a family's blocks are cut for tensor parallelism (Note [tensor plans])."""

    blocks: tuple[BlockCuts, ...]


@dataclass
class _Layout:
    """How one inner dimension is laid out: ``units`` of ``unit`` channels, padded to ``padded``."""

    units: int
    unit: int
    padded: int

    @property
    def size(self) -> int:
        return self.units * self.unit

    def local(self, degree: int) -> int:
        return self.padded * self.unit // degree

    def rank_slice(self, rank: int, degree: int) -> list[int]:
        """Rank ``rank``'s positions in the original dimension, -1 for padding."""
        n = self.local(degree)
        return [i if i < self.size else -1 for i in range(rank * n, (rank + 1) * n)]


@dataclass
class TensorRecord:
    """What ``apply_tensor_parallel`` changed, for ``remove``: per parameter its module, name,
    sharded dim and index map; per module the int attributes it changed (head counts, widths:
    restored last first); per module the hooks added."""

    params: list[tuple[torch.nn.Module, str, int, torch.Tensor, bool]] = field(default_factory=list)
    heads: list[tuple[torch.nn.Module, dict[str, int]]] = field(default_factory=list)
    hooks: list[tuple[torch.nn.Module, set[int], set[int]]] = field(default_factory=list)
    grad_hooks: list = field(default_factory=list)  # RemovableHandles of _sum_partial_gradients


def _layout(block: torch.nn.Module, split: Split, degree: int) -> _Layout:
    if split.width is not None:
        size = _attribute(block, split.width)
    else:
        size = block.get_submodule(split.columns[0]).out_features // split.packs
    units, unit = size, 1
    if split.heads is not None:
        units = _head_count(block.get_submodule(split.heads))
        unit = size // units
    return _Layout(units, unit, -(-units // degree) * degree)


def _index(parts: list[_Layout], degree: int) -> torch.Tensor:
    """Rank-major index map of a dimension made of ``parts`` (Note [uneven tensor splits]): entry
    j is the original position of row j of the laid-out tensor, -1 for padding."""
    offsets, total = [], 0
    for part in parts:
        offsets.append(total)
        total += part.size
    index: list[int] = []
    for rank in range(degree):
        for part, offset in zip(parts, offsets):
            index.extend(i + offset if i >= 0 else -1 for i in part.rank_slice(rank, degree))
    return torch.tensor(index, dtype=torch.long)


def _attribute(block: torch.nn.Module, path: str) -> int:
    owner, _, name = path.rpartition(".")
    return getattr(block.get_submodule(owner), name)


def _set_local_width(record: TensorRecord, block: torch.nn.Module, path: str, local: int) -> None:
    """``Split.width``: the attribute at ``path`` becomes a tensor rank's size of the dimension."""
    owner, _, name = path.rpartition(".")
    module = block.get_submodule(owner)
    record.heads.append((module, {name: getattr(module, name)}))
    setattr(module, name, local)


def _fused_index(block: torch.nn.Module, cuts: BlockCuts, fused: Fused, layouts: list[_Layout],
                 degree: int) -> torch.Tensor:
    """The rank-major index map of a ``Fused`` projection's rows: [each split's packs] per rank.

    Raises:
        ValueError: the projection's width is not the sum of its splits' (a plan that does not fit the model).
    """
    parts = [layouts[i] for i in fused.splits for _ in range(cuts.splits[i].packs)]
    width = block.get_submodule(fused.column).out_features
    if width != sum(p.size for p in parts):
        raise ValueError(
            f"tensor plan: {fused.column} makes {width} channels, its splits {list(fused.splits)} "
            f"{sum(p.size for p in parts)} ({[p.size for p in parts]}); the plan does not fit this model"
        )
    return _index(parts, degree)


def _laid_out(t: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` with its ``dim`` rearranged by ``index`` (rows of -1: zeros)."""
    shape = list(t.shape)
    shape[dim] = index.numel()
    out = t.new_zeros(shape)
    keep = (index >= 0).nonzero().squeeze(1)
    out.index_copy_(dim, keep, t.index_select(dim, index[keep]))
    return out


def _restored(t: torch.Tensor, index: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    shape = list(t.shape)
    shape[dim] = size
    out = t.new_empty(shape)
    keep = (index >= 0).nonzero().squeeze(1)
    out.index_copy_(dim, index[keep], t.index_select(dim, keep))
    return out


def _lay_out_linear(record: TensorRecord, linear: torch.nn.Module, index: torch.Tensor, column: bool) -> None:
    """Rearrange (and pad) a Linear's weight rows (column-parallel; and bias) or columns (row-parallel)."""
    names = ("weight", "bias") if column else ("weight",)
    for name in names:
        param = getattr(linear, name, None)
        if param is None:
            continue
        dim = 0 if column else 1
        record.params.append((linear, name, dim, index, param.requires_grad))
        with torch.no_grad():
            setattr(linear, name, torch.nn.Parameter(_laid_out(param.data, index, dim), requires_grad=param.requires_grad))
    if column:
        linear.out_features = index.numel()
    else:
        linear.in_features = index.numel()


# The attributes from which Diffusers' processors read the head count: ``unflatten(-1, (attn.heads, -1))``
# (Wan, CogVideoX), ``attn.inner_dim // attn.heads`` (Qwen-Image), ``attn.head_dim`` (Flux: unchanged);
# ``attn.num_heads`` where a module has no ``heads`` (Ideogram 4, with ``hidden_size`` its heads x head_dim).
_HEAD_ATTRS = ("heads", "inner_dim", "inner_kv_dim")
_NUM_HEADS_ATTRS = ("num_heads", "hidden_size")


def _head_attrs(attention: torch.nn.Module) -> tuple[str, tuple[str, ...]]:
    """(the attribute holding ``attention``'s head count, every attribute that scales with it)."""
    if isinstance(getattr(attention, "heads", None), int):
        return "heads", _HEAD_ATTRS
    return "num_heads", _NUM_HEADS_ATTRS


def _head_count(attention: torch.nn.Module) -> int:
    return getattr(attention, _head_attrs(attention)[0])


def _set_local_heads(record: TensorRecord, attention: torch.nn.Module, heads: int, head_dim: int) -> None:
    """Make ``attention`` describe a tensor rank's ``heads`` (its head_dim unchanged)."""
    count, attrs = _head_attrs(attention)
    saved = {a: getattr(attention, a) for a in attrs if isinstance(getattr(attention, a, None), int)}
    record.heads.append((attention, saved))
    total = saved[count]
    for attr, value in saved.items():
        setattr(attention, attr, heads if attr == count else value * heads // total if value == total * head_dim
                else value)


def _sum_partial_gradients(record: TensorRecord, attention: torch.nn.Module, cut: set[int], mesh: DeviceMesh) -> None:
    """Note [per-head weights under tensor parallelism]: the attention's whole weights that act on
    each head alike (QK norms: (head_dim,)) see a tensor rank's heads only, so each rank's gradient
    of them is a partial sum; a hook sums it over the tensor group as it arrives (before it is
    accumulated into ``.grad``, so gradient accumulation over micro-batches stays right)."""
    group = mesh.get_group()
    for module in attention.modules():
        if id(module) in cut:
            continue
        for param in module.parameters(recurse=False):
            if param.requires_grad:
                record.grad_hooks.append(param.register_hook(functools.partial(_all_reduced, group=group)))


def _all_reduced(grad: torch.Tensor, group) -> torch.Tensor:
    grad = grad.contiguous().clone()
    torch.distributed.all_reduce(grad, group=group)
    return grad


class _EmptySafe:
    """A cut Linear's forward that answers an input of no tokens itself.

    A rank's shard of a stream can be empty (Flux's text on a rank that holds only image tokens),
    and DTensor's sharding propagation fails on a view of an empty sharded tensor ("integer modulo
    by zero"). The tensor ranks hold the same tokens, so all of them take this path together and
    no collective is skipped on one rank alone; the output has no elements, so it carries no
    gradient to the weights either.
    """

    def __init__(self, linear: torch.nn.Module, column: bool) -> None:
        self.forward = type(linear).forward.__get__(linear)
        self.linear, self.column = linear, column

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() != 0:
            return self.forward(x)
        from torch.distributed.tensor import Replicate, Shard

        weight = self.linear.weight
        local = weight.to_local() if isinstance(weight, DTensor) else weight
        out = x.to_local() if isinstance(x, DTensor) else x
        width = local.shape[0]
        empty = out.new_zeros(*out.shape[:-1], width) + 0 * local.sum()  # keeps the graph (no elements)
        placement = Shard(out.dim() - 1) if self.column else Replicate()
        return DTensor.from_local(empty, weight.device_mesh, [placement], run_check=False)


def _cut_block(record: TensorRecord, block: torch.nn.Module, cuts: BlockCuts, mesh: DeviceMesh) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    degree = mesh.size()
    layouts = [_layout(block, split, degree) for split in cuts.splits]
    styles: dict[str, object] = {}
    for split, layout in zip(cuts.splits, layouts):
        for path in split.columns:
            _lay_out_linear(record, block.get_submodule(path), _index([layout] * split.packs, degree), True)
            styles[path] = ColwiseParallel()
        for path in split.rows:
            _lay_out_linear(record, block.get_submodule(path), _index([layout], degree), False)
            styles[path] = RowwiseParallel()
    for fused in cuts.fused:
        _lay_out_linear(record, block.get_submodule(fused.column), _fused_index(block, cuts, fused, layouts, degree),
                        True)
        styles[fused.column] = ColwiseParallel()
    for concat in cuts.concats:
        index = _index([layouts[i] for i in concat.splits], degree)
        _lay_out_linear(record, block.get_submodule(concat.row), index, False)
        styles[concat.row] = RowwiseParallel()
    cut = {id(block.get_submodule(p)) for p in styles}  # every cut Linear (inside an attention or not)
    for split, layout in zip(cuts.splits, layouts):
        if split.heads is not None:
            attention = block.get_submodule(split.heads)
            _set_local_heads(record, attention, layout.padded // degree, layout.unit)
            _sum_partial_gradients(record, attention, cut, mesh)
        if split.width is not None:
            _set_local_width(record, block, split.width, layout.local(degree))
    for path, style in styles.items():
        module = block.get_submodule(path)
        record.hooks.append((module, set(module._forward_pre_hooks), set(module._forward_hooks)))
        module.forward = _EmptySafe(module, isinstance(style, ColwiseParallel))
    parallelize_module(block, mesh, styles)
    for path, style in styles.items():
        if isinstance(style, RowwiseParallel):  # after DTensor's own hooks: the output is the summed local tensor
            block.get_submodule(path).register_forward_hook(functools.partial(_count_reduce, group_size=degree))


def _count_reduce(module: torch.nn.Module, args: tuple, output: torch.Tensor, group_size: int) -> None:
    """Count a row-parallel Linear's all-reduce (traffic kind "tensor_all_reduce", Note [counting
    traffic]): its output's bytes over the tensor group, the ring algorithm's volume. Removed with
    the cut (``remove`` drops every hook added after ``record.hooks``' snapshot)."""
    if traffic.counting():
        local = output.to_local() if isinstance(output, DTensor) else output
        traffic.record_all_reduce("tensor_all_reduce", traffic.nbytes(local), group_size)


def check_tensor_plan(transformer: torch.nn.Module, plan: TensorPlan | None, family: str, degree: int) -> None:
    """Before anything changes: a family without a tensor plan, or weights that cannot be cut.

    Raises:
        NotImplementedError: the family declares no tensor plan; LoRA (PEFT) layers are injected
            (their adapter weights would stay whole); Q/K/V projections fused by
            ``fuse_qkv_projections`` (the plan cuts the separate ones, which the processor then skips);
            a parameter is not a plain tensor (already a DTensor: sharded or parallelised; a
            quantized tensor subclass).
    """
    if plan is None:
        raise NotImplementedError(
            f"tensor_degree={degree}: usp_dit's {family} plan declares no tensor-parallel cuts (Note [tensor plans] in "
            f"usp_dit.pipelines.tensor: a family is cut only where the maths stays exact); use tensor_degree=1 and "
            f"put the ranks on ulysses_degree / ring_degree, or shard_weights=True for memory"
        )
    for name, module in transformer.named_modules():
        if type(module).__module__.startswith("peft."):
            raise NotImplementedError(
                f"tensor_degree={degree} with LoRA (PEFT) layers injected ({name}): the adapter weights would stay "
                f"whole beside cut base weights; fuse or unload the adapter first"
            )
        if getattr(module, "fused_projections", False):
            raise NotImplementedError(
                f"tensor_degree={degree} with fused Q/K/V projections ({name}: fuse_qkv_projections): the tensor "
                f"plan cuts the separate to_q / to_k / to_v; call unfuse_qkv_projections() first"
            )
    for name, param in transformer.named_parameters():
        if type(param) is not torch.nn.Parameter or type(param.data) is not torch.Tensor:
            raise NotImplementedError(
                f"tensor_degree={degree}: parameter {name} is a {type(param.data).__name__}, not a plain tensor "
                f"(sharded, already parallelised or quantized); tensor parallelism cuts plain weights only"
            )


def apply_tensor_parallel(transformer: torch.nn.Module, plan: TensorPlan, mesh: USPMesh) -> TensorRecord:
    """Cut every block of ``plan`` over ``mesh``'s tensor group (Note [tensor plans]); the record
    undoes it (``remove_tensor_parallel``)."""
    device_mesh = mesh.tensor_device_mesh
    record = TensorRecord()
    for cuts in plan.blocks:
        for block in getattr(transformer, cuts.block_list):
            _cut_block(record, block, cuts, device_mesh)
    return record


def remove_tensor_parallel(record: TensorRecord) -> None:
    """Every cut parameter back whole (gathered, rows put back, padding dropped: bit for bit), the
    attentions' head counts and the modules' hooks as they were. Collective over the tensor group."""
    for handle in record.grad_hooks:
        handle.remove()
    record.grad_hooks.clear()
    for module, pre, post in record.hooks:
        # distribute_module marks the module so it is not distributed twice; the mark goes with the hooks
        module.__dict__.pop("_distribute_module_applied", None)
        module.__dict__.pop("forward", None)  # the _EmptySafe wrapper
        for key in set(module._forward_pre_hooks) - pre:
            del module._forward_pre_hooks[key]
        for key in set(module._forward_hooks) - post:
            del module._forward_hooks[key]
    for module, name, dim, index, requires_grad in record.params:
        param = getattr(module, name)
        full = param.data.full_tensor() if isinstance(param.data, DTensor) else param.data
        original = int((index >= 0).sum())
        with torch.no_grad():
            setattr(module, name, torch.nn.Parameter(_restored(full, index, dim, original), requires_grad=requires_grad))
        if name == "weight":
            if dim == 0:
                module.out_features = original
            else:
                module.in_features = original
    for module, saved in reversed(record.heads):  # last first: a width may also scale with the heads (inner_dim)
        for attr, value in saved.items():
            setattr(module, attr, value)
    for module in {id(m): m for m, *_ in record.params}.values():  # biases not cut stay DTensors: make them plain
        for name, param in list(module.named_parameters(recurse=False)):
            if isinstance(param.data, DTensor):
                setattr(module, name, torch.nn.Parameter(param.data.full_tensor(), requires_grad=param.requires_grad))
    record.params.clear()
    record.heads.clear()
    record.hooks.clear()


def full_tensor(record: TensorRecord, module: torch.nn.Module, name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` (a cut parameter of ``module`` or its gradient, possibly a DTensor) gathered and put back in
    the original layout: the tensor one process would hold (for checks and checkpoints)."""
    full = t.full_tensor() if isinstance(t, DTensor) else t
    for mod, pname, dim, index, _ in record.params:
        if mod is module and pname == name:
            return _restored(full, index, dim, int((index >= 0).sum()))
    return full
