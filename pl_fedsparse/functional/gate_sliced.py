"""pFedGate's ``compute: sliced`` forward: the block-sparse personalised model ``θ' = θ ⊙ expand(M')`` run with
smaller dense ops that skip the output rows ``θ'`` has dropped entirely (Chen et al., "Efficient Personalized
Federated Learning via Sparse Model-Adaptation", ICML 2023, arXiv 2305.02776, App. F "Storage": "the intermediate
tensor involved in the forward and backward processes through the sparse model is correspondingly smaller based on
block sparsity", measured in §7.4, Table 2). The authors' code masks densely (``yxdyc/pFedGate@b8cfa156``,
``models/adapted_op.py``: dense masked weights, no sparse kernels, so Table 2 cannot come from it), as does the default
``compute: masked`` (:func:`pl_fedsparse.models.gate.adapted_forward`).

**Why rows.** The block split (§5.2.2, :func:`~pl_fedsparse.functional.gate.split_sizes`, either variant) cuts every
flattened tensor into contiguous ranges, so a block of a conv weight ``[out, in, kh, kw]`` or a linear weight
``[out, in]`` is a run of whole output rows (filters) plus, where a boundary falls inside a row, part of one row at
each end. Every output row ``o`` of a layer is therefore one of:

* **dropped**: all its elements lie in dropped blocks, so ``θ'_o = 0`` exactly (``I* = 0`` makes ``M'`` exactly 0:
  ``0 − G + G = 0`` in IEEE arithmetic) and its output is exactly the personalised bias ``b'_o`` (``b_o · M'`` of the
  bias's own block, or 0 when that block is dropped; no bias: 0) at every position;
* **active**: at least one element is kept. A **partially kept** row (a block boundary cuts through it, e.g. filter
  12 of LeNet-CIFAR's ``conv2``: 640 of its 800 weights in block 0) is computed densely with its masked ``θ'_o``,
  zeros included — exactly what the masked forward computes for that row, so no special case is needed.

The sliced op computes only the active rows (``conv2d(x, θ'[active])``), writes them and the dropped rows' constant
``b'`` into the full-sized output, and lets autograd differentiate that: the input gradient comes from the active
rows only (the dropped rows add ``θ'_o · g = 0``), the weight gradient of the active rows is the masked one.

**The dropped rows' weight gradient** ``∂L/∂θ'_o = g_o ⋆ x`` is not zero in general, and the paper's straight-through
estimator (App. A, ``variant="paper"``) passes ``θ ⊙ ∂L/∂θ'`` of dropped blocks on to ``G``. With
``dropped_grad=True`` (needed for ``variant="paper"``) a zero-valued term whose backward computes that gradient —
only for the dropped rows whose output gradient is not identically zero — is added to their output; rows behind a
ReLU whose bias is dropped (output exactly 0, ReLU'(0) = 0) get an exactly-zero gradient and cost nothing. With the
code's estimator (``variant="code"``) a dropped block passes no gradient at all (``∂M'/∂G = ∂M'/∂M = 0`` there) and
``dropped_grad=False`` skips the term; the gradients are still those of the masked forward.

**Where it applies** (otherwise the layer runs masked, through the module's own forward — exact by construction):
``nn.Conv2d`` with ``groups=1`` and ``padding_mode="zeros"`` and ``nn.Linear`` (exactly these classes, not
subclasses that may override ``forward``), whose ``weight`` is in the block table, when at least one row is dropped
and one is kept, with a batched input (an unbatched ``[C, H, W]`` image runs masked).
Other operators (BatchNorm, grouped or 1-d/3-d convolutions, attention …) are masked.

**Not done: skipping the next layer's input slice.** A dropped row's output is the constant ``b'_o``; when that is 0
(its bias block dropped), the next layer's matching input channel is zero and its forward could skip it, but the
input gradient of that channel may still be needed upstream (it is only provably dead behind a ReLU), so skipping
exactly needs a custom backward. On LeNet-CIFAR it would save little: the code's greedy knapsack keeps ``conv1``
whole at s = 0.5 and 0.3 (its blocks are light), and the only consumer of ``conv2``'s dropped channels is ``fc1``
(≈ 3 % of the dense model's FLOPs, already cut to its kept rows).

**Memory and time.** Activations stay full-sized (the dropped rows' constant outputs are materialised, then
ReLU/pool run on the whole tensor), so peak memory does not fall where it is set by the first layer's activations
(LeNet-CIFAR: conv1's ReLU backward); the time saved is the skipped rows' forward, input-gradient and (code
estimator, or dead rows) weight-gradient work. Measured by ``papers/pfedgate/pfedgate_cost.py`` (its page:
``papers/pfedgate/README.md``).

Example (with the code's greedy knapsack LeNet-CIFAR's conv2 keeps 13 of its 64 filters at s = 0.3):
    >>> from pl_fedsparse.functional.gate import block_table, select_blocks
    >>> from pl_fedsparse.models import LeNetCIFAR
    >>> model = LeNetCIFAR()
    >>> t = block_table(model)
    >>> keep = select_blocks(torch.full((t.num_blocks,), 0.5), t, 0.3)
    >>> [(name, int(rows.sum()), rows.numel()) for name, rows in active_rows(keep, t, ["conv2.weight"]).items()]
    [('conv2.weight', 13, 64)]
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pl_fedsparse.errors import check
from pl_fedsparse.functional.gate import BlockTable
from pl_fedsparse.functional.shadowing import replace_methods, restore_methods

__all__ = ["active_rows", "sliceable_layers", "sliced_forward"]


def sliceable_layers(model: nn.Module, table: BlockTable) -> dict[str, str]:
    """The layers of ``model`` that ``compute: sliced`` can run by output rows: module name → weight name.

    ``nn.Conv2d`` (``groups=1``, ``padding_mode="zeros"``) and ``nn.Linear`` modules (exactly these classes) whose
    ``weight`` is a tensor of the block table. Every other layer runs masked.

    Example:
        >>> from pl_fedsparse.functional.gate import block_table
        >>> m = nn.Sequential(nn.Conv2d(3, 4, 3, groups=1), nn.Conv2d(4, 4, 3, groups=2), nn.Flatten(),
        ...                   nn.Linear(4, 2))
        >>> sliceable_layers(m, block_table(m))
        {'0': '0.weight', '3': '3.weight'}
    """
    names = set(table.names)
    out: dict[str, str] = {}
    for name, module in model.named_modules():
        weight = f"{name}.weight" if name else "weight"
        if weight not in names:
            continue
        plain_conv = type(module) is nn.Conv2d and module.groups == 1 and module.padding_mode == "zeros"
        if plain_conv or type(module) is nn.Linear:
            out[name] = weight
    return out


def active_rows(keep: Tensor | Sequence[bool], table: BlockTable, names: Sequence[str] | None = None
                ) -> dict[str, Tensor]:
    """Per weight tensor, which output rows (dim 0) hold at least one element of a kept block.

    Row ``o`` of a tensor with ``r`` elements per row spans the flat range ``[o·r, (o+1)·r)``; a kept block
    ``[a, a + w)`` makes rows ``⌊a/r⌋ … ⌊(a+w−1)/r⌋`` active (the first and last of them may be partially kept).

    Args:
        keep: the block index ``I*`` ``[L]`` (bool tensor or sequence).
        table: the block split.
        names: the tensors to report (default: all of the table's tensors).

    Returns:
        name → bool tensor ``[shape[0]]`` on the CPU.

    Example (rows of 3 elements, blocks of 4: blocks 0 and 2 kept touch rows 0-1 and 2-3, block 1 alone rows 1-2):
        >>> from pl_fedsparse.functional.gate import make_block_table
        >>> t = make_block_table([("w", (4, 3), True)], num_splits=3)
        >>> active_rows([True, False, False], t)["w"].tolist(), active_rows([False, True, False], t)["w"].tolist()
        ([True, True, False, False], [False, True, True, False])
    """
    flags = keep.tolist() if isinstance(keep, Tensor) else list(keep)
    check(len(flags) == table.num_blocks, "keep", len(flags), f"one flag per block ({table.num_blocks})")
    wanted = table.names if names is None else names
    index = {n: i for i, n in enumerate(table.names)}
    out: dict[str, Tensor] = {}
    for name in wanted:
        check(name in index, "names", name, "names of the block table's tensors")
        i = index[name]
        shape = table.shapes[i]
        rows = shape[0] if shape else 1
        per_row = math.prod(shape) // rows
        mask = torch.zeros(rows, dtype=torch.bool)
        begin, end = table.spans[i]
        for j in range(begin, end):
            if flags[j]:
                a = table.starts[j]
                mask[a // per_row:(a + table.sizes[j] - 1) // per_row + 1] = True
        out[name] = mask
    return out


class _DroppedRowsWeightGrad(torch.autograd.Function):
    """A zero-valued output for the dropped rows whose backward gives ``∂L/∂θ'`` of those rows, as the masked forward
    would: ``grad_w = g ⋆ x`` for each row whose output gradient ``g`` is not identically zero, else exactly 0. No
    gradient to ``x``: the masked forward's ``θ'_o · g`` is exactly 0 since ``θ'_o = 0``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, out_shape: tuple[int, ...], dtype: torch.dtype,
                conv: tuple[Any, ...] | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.conv = conv
        return x.new_zeros(out_shape, dtype=dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor | None, None, None, None]:
        x, weight = ctx.saved_tensors
        if not ctx.needs_input_grad[1]:
            return None, None, None, None, None
        grad_w = torch.zeros_like(weight)
        if ctx.conv is None:  # linear: [..., n] output, [..., in] input
            g = grad.reshape(-1, grad.shape[-1])
            live = g.ne(0).any(0).nonzero().flatten()
            if live.numel():
                grad_w[live] = (g[:, live].t() @ x.reshape(-1, x.shape[-1]).to(g.dtype)).to(weight.dtype)
        else:
            live = grad.ne(0).transpose(0, 1).flatten(1).any(1).nonzero().flatten()
            if live.numel():
                stride, padding, dilation = ctx.conv
                w_live = weight[live]
                _, gw, _ = torch.ops.aten.convolution_backward(
                    grad[:, live].contiguous(), x.to(grad.dtype), w_live.to(grad.dtype), None, stride, padding,
                    dilation, False, [0, 0], 1, [False, True, False])
                grad_w[live] = gw.to(weight.dtype)
        return None, grad_w, None, None, None


@dataclass(frozen=True)
class _RowPlan:
    """Which output rows of one layer to compute: index tensors and the maximal runs of equal status in row order
    (``(active, first row, rows)``), so that a single run is taken as a view and the output is one ``cat``."""

    active: Tensor
    dropped: Tensor
    runs: tuple[tuple[bool, int, int], ...]

    @staticmethod
    def of(mask: Tensor, device: torch.device) -> _RowPlan:
        flags = mask.tolist()
        runs: list[tuple[bool, int, int]] = []
        for row, flag in enumerate(flags):
            if runs and runs[-1][0] == flag:
                runs[-1] = (flag, runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((flag, row, 1))
        return _RowPlan(mask.nonzero().flatten().to(device), (~mask).nonzero().flatten().to(device), tuple(runs))

    def take(self, t: Tensor, active: bool) -> Tensor:
        """The active (or dropped) rows of ``t`` along dim 0, in row order: a view when they are one run."""
        runs = [(a, n) for flag, a, n in self.runs if flag == active]
        if len(runs) == 1:
            return t.narrow(0, runs[0][0], runs[0][1])
        return t.index_select(0, self.active if active else self.dropped)

    def assemble(self, computed: Tensor, fill: Tensor, dim: int) -> Tensor:
        """The full output from the active rows' ``computed`` and the dropped rows' ``fill`` (one ``cat``)."""
        pieces: list[Tensor] = []
        offsets = {True: 0, False: 0}
        for flag, _, n in self.runs:
            source = computed if flag else fill
            pieces.append(source if n == source.shape[dim] else source.narrow(dim, offsets[flag], n))
            offsets[flag] += n
        return torch.cat(pieces, dim)


def _sliced_layer(module: nn.Module, plan: _RowPlan, dropped_grad: bool, x: Tensor) -> Tensor:
    """The forward of one conv/linear layer by rows (``module.weight``/``bias`` are ``θ'`` inside
    ``functional_call``)."""
    weight = cast(Tensor, module.weight)
    bias = cast("Tensor | None", module.bias)
    is_conv = isinstance(module, nn.Conv2d)
    if is_conv and x.dim() != 4:  # an unbatched image: the module's own (masked) forward
        return type(module).forward(module, x)
    w_act = plan.take(weight, True)
    b_act = plan.take(bias, True) if bias is not None else None
    if is_conv:
        assert isinstance(module, nn.Conv2d)
        y_act = F.conv2d(x, w_act, b_act, module.stride, module.padding, module.dilation)
        dim = 1
    else:
        y_act = F.linear(x, w_act, b_act)
        dim = y_act.dim() - 1
    shape = list(y_act.shape)
    shape[dim] = int(plan.dropped.numel())
    if bias is not None:  # a dropped row's output: its personalised bias b'_o everywhere (θ'_o = 0)
        view = [1] * len(shape)
        view[dim] = -1
        fill = plan.take(bias, False).to(y_act.dtype).view(view).expand(shape)
    else:
        fill = y_act.new_zeros(shape)
    if dropped_grad and torch.is_grad_enabled() and weight.requires_grad:
        conv = (module.stride, module.padding, module.dilation) if is_conv else None
        fill = fill + _DroppedRowsWeightGrad.apply(x.detach(), plan.take(weight, False), tuple(shape), y_act.dtype,
                                                   conv)
    return plan.assemble(y_act, fill, dim)


@contextlib.contextmanager
def _rows_installed(model: nn.Module, plans: Mapping[str, _RowPlan], dropped_grad: bool) -> Iterator[None]:
    patched: list[tuple[nn.Module, dict[str, Any]]] = []
    try:
        for name, plan in plans.items():
            module = model.get_submodule(name)

            def forward(x: Tensor, _m: nn.Module = module, _p: _RowPlan = plan) -> Tensor:
                return _sliced_layer(_m, _p, dropped_grad, x)

            patched.append((module, replace_methods(module, forward=forward)))
        yield
    finally:
        for module, before in reversed(patched):
            restore_methods(module, before)


def sliced_forward(model: nn.Module, params: Mapping[str, Tensor], x: Tensor, keep: Tensor, table: BlockTable, *,
                   dropped_grad: bool = True, relu_logits: bool = False,
                   layers: Mapping[str, str] | None = None) -> Tensor:
    """The personalised model's logits, as :func:`pl_fedsparse.models.gate.adapted_forward` (same values and
    gradients to θ and to the gate, to float tolerance), with every sliceable layer that has dropped output rows run
    on its active rows only (see the module docstring).

    Args:
        model: the global model (its own tensors are neither replaced nor written).
        params: ``θ'`` by name (:func:`~pl_fedsparse.functional.gate.personalized_params` with the same ``keep``).
        x: the input batch.
        keep: the block index ``I*`` ``[L]`` that produced ``params``.
        table: the block split.
        dropped_grad: compute the dropped rows' weight gradient (needed for the paper's straight-through estimator,
            where dropped blocks still pass gradient to ``G``); ``False`` is exact only for the code's estimator.
        relu_logits: the code's ReLU on the logits (default off).
        layers: :func:`sliceable_layers` of ``model`` (computed when ``None``; pass it to save the walk per batch).

    Returns:
        The logits.

    Example:
        >>> from pl_fedsparse.functional.gate import block_table, personalized_params, select_blocks
        >>> from pl_fedsparse.models import LeNetCIFAR
        >>> from pl_fedsparse.models.gate import adapted_forward
        >>> _ = torch.manual_seed(0); model = LeNetCIFAR(); t = block_table(model); x = torch.randn(4, 3, 32, 32)
        >>> keep = select_blocks(torch.rand(t.num_blocks), t, 0.3)
        >>> theta = personalized_params(dict(model.named_parameters()), keep.float(), t)
        >>> torch.allclose(sliced_forward(model, theta, x, keep, t), adapted_forward(model, theta, x), atol=1e-5)
        True
    """
    check(isinstance(keep, Tensor) and keep.shape == (table.num_blocks,), "keep",
          tuple(keep.shape) if isinstance(keep, Tensor) else keep, f"a bool tensor of shape ({table.num_blocks},)")
    layers = sliceable_layers(model, table) if layers is None else layers
    rows = active_rows(keep, table, list(layers.values()))
    plans: dict[str, _RowPlan] = {}
    for name, weight in layers.items():
        mask = rows[weight]
        if bool(mask.all()) or not bool(mask.any()):
            continue  # nothing dropped, or nothing kept (a hand-made keep): the module's own forward
        device = params[weight].device if weight in params else x.device
        plans[name] = _RowPlan.of(mask, device)
    with _rows_installed(model, plans, dropped_grad):
        out = torch.func.functional_call(model, dict(params), (x,))
    return F.relu(out) if relu_logits else out
