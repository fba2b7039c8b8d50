"""pFedGate's tensor maths (Chen et al., "Efficient Personalized Federated Learning via Sparse Model-Adaptation",
ICML 2023, arXiv 2305.02776; the authors' code ``yxdyc/pFedGate@b8cfa156``, ``models/gating_layers.py`` and
``gated_learner.py``): the operator-type-free block split (§5.2.2), the block-size look-up table ``W``,
the knapsack that turns block importances ``G`` into the binary index ``I*`` under a density budget ``s`` (Eq. 6),
the straight-through estimator ``M' = I_ST ⊙ M`` (App. A) and the sparse personalised parameters
``θ' = θ ⊙ expand(M')`` for a functional forward (§5.1, Alg. 1 line 4). The gating layer itself (an ``nn.Module``
with buffers) is :class:`pl_fedsparse.models.gate.GatingLayer`.

Where the paper and the authors' code differ, each choice is an argument:

* **Block split** (``split``): ``"equal"`` (default, the code's ``GatingLayer.__init__``, ``models/gating_layers.py``):
  every flattened parameter tensor is cut into ``B`` equal chunks (the last one shorter) and the first chunk of every
  tensor is always kept; ``"paper"`` (§5.2.2): a first block of ``⌊s_min · d_l⌋`` elements (at least 1), then ``B − 1``
  equal blocks of the rest.
* **Knapsack** (``solver``): ``"greedy"`` (default, the code's ``KnapsackSolver01.found_max_value_greedy`` called from
  ``gated_learner.py:select_top_trans_weights``): blocks ranked by the integer value ``round(10·G)`` and taken while
  they fit, solved separately for the blocks of ``nn.Linear`` parameters and for all other blocks, each with capacity
  ``round(W_group · (s − s_min))`` over its non-first blocks; this reproduces the paper's achieved densities
  s' = 0.43 / 0.25 at s = 0.5 / 0.3. ``"exact"``: the paper's Eq. 6, ``max I·G s.t. |I·W| ≤ s·d`` solved exactly
  over all blocks at once (first blocks forced in). ``budget`` (``"group"`` / ``"global"``) decouples the capacity
  rule from the solver when both are wanted separately.
* **Straight-through** (``variant``): ``"paper"`` (default, App. A: ``I_ST = I* − G.detach() + G``; a dropped block
  still passes ``M_j · ∂L/∂M'_j`` to ``G_j``) or ``"code"`` (``gated_learner.py:204-225``: ``(1 − G.detach() + G)``
  with the dropped entries zeroed, so a dropped block passes no gradient; and at s = 1, ``M' = M`` with no
  straight-through term at all).
* **s < 1/B with the equal split** (the code keeps every tensor's first chunk, so its real density stays 1/B while the
  knapsack capacity becomes 0): refused with a one-line error; use ``split="paper"`` with ``s_min ≤ s`` or a larger B.

Choices made here where the code's behaviour depends on the platform: the greedy breaks ties between equal integer
values by block index (the code uses numpy's unstable ``argsort``, whose tie order depends on the numpy version and
CPU); the exact solver breaks ties towards the lighter, then the earlier-found selection. The paper split can give a
tiny tensor fewer than ``B`` blocks, so ``L`` may differ from the equal split's (LeNet-CIFAR at s_min = 0.1: 49, not
50). The exact solver's Pareto front is small for the paper's models (LeNet: ~1 ms per batch) but grows with many
distinct block sizes (ResNet-18-GN, 310 blocks: ~0.2 s per batch on one CPU core).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import Tensor, nn

from pl_fedsparse.errors import check
from pl_fedsparse.functional import transfer
from pl_fedsparse.functional.masks import check_density

__all__ = [
    "BlockTable",
    "achieved_density",
    "adapt_gated_weights",
    "block_table",
    "code_s_min",
    "expand_block_weights",
    "knapsack_exact",
    "knapsack_greedy",
    "knapsack_greedy_rows",
    "knapsack_greedy_tensor",
    "block_span_tensors",
    "make_block_table",
    "personalized_params",
    "select_blocks",
    "sparse_gated_weights",
    "split_sizes",
    "straight_through",
]

Split = Literal["equal", "paper"]
Solver = Literal["greedy", "exact"]
Budget = Literal["group", "global"]
Variant = Literal["paper", "code"]

#: the code's ``gated_scores_scale_factor``: importances are ranked as the integers ``round(10 · G)``
IMPORTANCE_LEVELS = 10


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_s_min(s_min: object, param: str = "s_min") -> None:
    check(isinstance(s_min, (int, float)) and not isinstance(s_min, bool) and 0 < s_min < 1, param, s_min,
          "a number in (0, 1)")


def split_sizes(numel: int, num_splits: int = 5, *, split: Split = "equal", s_min: float | None = None) -> list[int]:
    """The block sizes of one flattened tensor of ``numel`` elements (§5.2.2 "operator-type-free block splitting").

    ``"equal"`` (the code, ``GatingLayer.__init__``): ``k = min(B, n)``, ``size = ⌈n/k⌉``, ``k = ⌈n/size⌉``, then
    ``k − 1`` blocks of ``size`` and a last one of ``n − (k−1)·size``; a tensor may get fewer than ``B`` blocks
    (16 elements at B = 5: four blocks of 4). ``"paper"``: a first block of ``max(1, ⌊s_min · n⌋)`` elements, then the
    rest cut the same way into at most ``B − 1`` blocks (the last one may be shorter).

    Args:
        numel: elements of the tensor (>= 1).
        num_splits: the split factor ``B`` (>= 2).
        split: ``"equal"`` or ``"paper"``.
        s_min: the paper's minimal density, the first block's share (``split="paper"`` only; default ``1/B``).

    Returns:
        The block sizes in the tensor's row-major order; they sum to ``numel``.

    Example:
        >>> split_sizes(32), split_sizes(16), split_sizes(3)
        ([7, 7, 7, 7, 4], [4, 4, 4, 4], [1, 1, 1])
        >>> split_sizes(100, split="paper", s_min=0.1), split_sizes(10, split="paper", s_min=0.3)
        ([10, 23, 23, 23, 21], [3, 2, 2, 2, 1])
    """
    check(_is_int(numel) and numel >= 1, "numel", numel, "an int >= 1")
    check(_is_int(num_splits) and num_splits >= 2, "num_splits", num_splits,
          "an int >= 2 (the split factor B; B = 1 leaves no block to select)")
    check(split in ("equal", "paper"), "split", split, "'equal' (the code) or 'paper' (§5.2.2)")

    def equal(n: int, parts: int) -> list[int]:
        k = min(parts, n)
        size = -(-n // k)
        k = -(-n // size)
        return [size] * (k - 1) + [n - (k - 1) * size]

    if split == "equal":
        return equal(numel, num_splits)
    s = 1.0 / num_splits if s_min is None else s_min
    _check_s_min(s)
    first = max(1, math.floor(s * numel))
    rest = numel - first
    return [first] + (equal(rest, num_splits - 1) if rest else [])


@dataclass(frozen=True)
class BlockTable:
    """The block split of a model's parameters: which blocks each tensor has and how large they are.

    Blocks are numbered ``0 … L−1`` in the order of ``model.named_parameters()`` and, inside a tensor, in the
    row-major order of its flattened elements (a conv weight ``[out, in, kh, kw]`` is cut into contiguous groups of
    output filters, a linear weight into groups of output rows).

    Attributes:
        names: parameter names, in model order.
        shapes: parameter shapes.
        spans: per parameter, its ``[begin, end)`` block indices (the code's ``para_name_to_block_split_info``).
        sizes: the look-up table ``W``: elements per block, length ``L``.
        starts: per block, the offset of its first element in its flattened tensor.
        linear: per block, whether its tensor belongs to an ``nn.Linear`` (the code's "linear" knapsack group).
        first: per block, whether it is the first block of its tensor (always kept).
        num_splits: the split factor ``B``.
        split: ``"equal"`` or ``"paper"``.
        s_min: the first-block share of the ``"paper"`` split (``None`` for ``"equal"``).
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    spans: tuple[tuple[int, int], ...]
    sizes: tuple[int, ...]
    starts: tuple[int, ...]
    linear: tuple[bool, ...]
    first: tuple[bool, ...]
    num_splits: int
    split: str
    s_min: float | None

    @property
    def num_blocks(self) -> int:
        """``L``, the number of blocks (the gating layer's output width)."""
        return len(self.sizes)

    @property
    def numel(self) -> int:
        """``d``, the number of split parameters."""
        return sum(self.sizes)

    @property
    def kept_numel(self) -> int:
        """Elements in the always-kept first blocks."""
        return sum(w for w, f in zip(self.sizes, self.first) if f)

    @property
    def block_names(self) -> tuple[str, ...]:
        """``"<param>.sub<j>"`` for every block, as the code names them."""
        return tuple(f"{n}.sub{j}" for n, (b, e) in zip(self.names, self.spans) for j in range(e - b))

    @property
    def min_density(self) -> float:
        """The smallest budget the split can honour: ``1/B`` for ``"equal"``, ``s_min`` for ``"paper"``."""
        return 1.0 / self.num_splits if self.s_min is None else self.s_min


def make_block_table(params: Sequence[tuple[str, Sequence[int], bool]], num_splits: int = 5, *,
                     split: Split = "equal", s_min: float | None = None) -> BlockTable:
    """Build a :class:`BlockTable` from ``(name, shape, is_linear)`` triples (see :func:`split_sizes`).

    Example:
        >>> t = make_block_table([("w", (4, 8), True), ("b", (4,), True)], num_splits=4)
        >>> t.sizes, t.spans, t.first, t.num_blocks, t.numel
        ((8, 8, 8, 8, 1, 1, 1, 1), ((0, 4), (4, 8)), (True, False, False, False, True, False, False, False), 8, 36)
    """
    check(len(params) > 0, "params", len(params), "at least one parameter tensor")
    if split == "paper":
        s_min = 1.0 / num_splits if s_min is None else s_min
        _check_s_min(s_min)
    else:
        check(s_min is None, "s_min", s_min, "None with split='equal' (the code's first chunks are 1/B)")
    names: list[str] = []
    shapes: list[tuple[int, ...]] = []
    spans: list[tuple[int, int]] = []
    sizes: list[int] = []
    starts: list[int] = []
    linear: list[bool] = []
    first: list[bool] = []
    for name, shape, is_linear in params:
        dims = tuple(int(s) for s in shape)
        parts = split_sizes(math.prod(dims), num_splits, split=split, s_min=s_min)
        spans.append((len(sizes), len(sizes) + len(parts)))
        offset = 0
        for j, w in enumerate(parts):
            sizes.append(w)
            starts.append(offset)
            linear.append(bool(is_linear))
            first.append(j == 0)
            offset += w
        names.append(name)
        shapes.append(dims)
    return BlockTable(tuple(names), tuple(shapes), tuple(spans), tuple(sizes), tuple(starts), tuple(linear),
                      tuple(first), num_splits, split, s_min)


def block_table(model: nn.Module, num_splits: int = 5, *, split: Split = "equal",
                s_min: float | None = None) -> BlockTable:
    """The :class:`BlockTable` of every tensor in ``model.named_parameters()`` (weights and biases, each split on its
    own; buffers are not split), with the owning module's type deciding the group (``nn.Linear`` → linear, anything
    else, convolutions included → non-linear), as the code's ``GatingLayer.__init__``. Works on ``meta`` models.

    Args:
        model: the global model θ.
        num_splits: the split factor ``B`` (5 in every experiment of the paper).
        split: ``"equal"`` (code, default) or ``"paper"`` (§5.2.2).
        s_min: the paper split's first-block share (default ``1/B``).

    Example:
        >>> t = block_table(nn.Sequential(nn.Conv2d(1, 2, 3), nn.Linear(4, 3)))
        >>> t.names, t.num_blocks, t.linear.count(True)
        (('0.weight', '0.bias', '1.weight', '1.bias'), 14, 7)
    """
    entries = []
    for name, p in model.named_parameters():
        owner = model.get_submodule(name.rpartition(".")[0])
        entries.append((name, tuple(p.shape), isinstance(owner, nn.Linear)))
    return make_block_table(entries, num_splits, split=split, s_min=s_min)


def code_s_min(num_splits: int, density: float) -> float:
    """The code's minimal density ``min(max(1/B, 0.1), s)`` (``gated_learner.py:49``): the clip floor of ``G`` and
    the share subtracted from the greedy's capacity.

    Example:
        >>> code_s_min(5, 0.5), code_s_min(5, 0.1), code_s_min(20, 0.5)
        (0.2, 0.1, 0.1)
    """
    return min(max(1.0 / num_splits, 0.1), density)


def knapsack_greedy(values: Sequence[float], weights: Sequence[int], capacity: int) -> list[bool]:
    """The code's greedy 0/1 knapsack (``KnapsackSolver01.found_max_value_greedy``): scan the items by value,
    largest first (ties: lower index first), take an item if it still fits, otherwise drop it and keep scanning.
    It ranks by value alone, not by value per weight.

    Example (the heavy item of value 9 is taken first, then only the weight-4 item still fits):
        >>> knapsack_greedy([9, 8, 8], [6, 5, 4], 10)
        [True, False, True]
    """
    check(len(values) == len(weights), "values", len(values), f"one value per weight ({len(weights)} weights)")
    order = sorted(range(len(values)), key=lambda j: -values[j])  # stable: ties by index
    taken = [False] * len(values)
    total = 0
    for j in order:
        if total + weights[j] <= capacity:
            total += weights[j]
            taken[j] = True
    return taken


def knapsack_greedy_tensor(values: Tensor, weights: Tensor, capacity: int, distinct_weights: int) -> Tensor:
    """:func:`knapsack_greedy` on tensors where they are, with no host synchronisation: the same selection.

    The scan "take the next item by value if it still fits" is sequential, but its failures are few: once an item
    of weight ``w`` does not fit, no later item of weight ``>= w`` can (the room left only shrinks), so each failure
    lowers a weight threshold to a smaller distinct weight, and there are at most ``distinct_weights`` of them.
    Each round takes, after the last failure, every item under the threshold up to the next one that does not fit
    (a cumulative sum and a first-index search); ``distinct_weights + 1`` rounds of a few vector operations, a fixed
    number known on the host, so the device never waits. (One knapsack of :func:`knapsack_greedy_rows`.)

    Args:
        values: ``[n]`` values (ranked largest first, ties by lower index: a stable sort).
        weights: ``[n]`` integer weights on the same device.
        capacity: the knapsack's capacity.
        distinct_weights: the number of distinct values in ``weights`` (or any upper bound).

    Returns:
        A bool tensor ``[n]``: which items are taken.

    Example:
        >>> knapsack_greedy_tensor(torch.tensor([9., 8., 8.]), torch.tensor([6, 5, 4]), 10, 3).tolist()
        [True, False, True]
    """
    return knapsack_greedy_rows(values.unsqueeze(0), weights.unsqueeze(0), capacity, distinct_weights).squeeze(0)


def knapsack_greedy_rows(values: Tensor, weights: Tensor, capacity: int | Tensor, distinct_weights: int) -> Tensor:
    """Several independent greedy knapsacks at once, one per row, with no host synchronisation: row ``g`` takes what
    :func:`knapsack_greedy` takes on ``(values[g], weights[g], capacity[g])``.

    The rounds of :func:`knapsack_greedy_tensor` run on every row together, so a selection of several groups (the
    paper's per-group budget: linear and convolution blocks) issues the device operations of one knapsack rather
    than one per group. Items of weight 0 never change a row's selection (they always fit and use no room): rows
    of different lengths are padded with them.

    Args:
        values: ``[G, n]`` values (each row ranked largest first, ties by lower index).
        weights: ``[G, n]`` non-negative integer weights on the same device.
        capacity: one capacity for every row, or a ``[G]`` integer tensor on the same device.
        distinct_weights: an upper bound on the number of distinct non-zero weights of any row.

    Returns:
        A bool tensor ``[G, n]``: which items each row takes.

    Example:
        >>> knapsack_greedy_rows(torch.tensor([[9., 8., 8.], [1., 2., 0.]]), torch.tensor([[6, 5, 4], [3, 3, 0]]),
        ...                      torch.tensor([10, 4]), 2).tolist()
        [[True, False, True], [False, True, True]]
    """
    rows, n = values.shape
    dev = values.device
    if n == 0:
        return torch.zeros(rows, 0, dtype=torch.bool, device=dev)
    order = torch.sort(values, dim=1, descending=True, stable=True).indices
    w = torch.gather(weights.to(torch.int64), 1, order)
    # a column past the end: the "weight" of "no failure" (then nothing is left to decide, so any value does)
    w_end = torch.cat([w, w.new_zeros(rows, 1)], 1)
    cap = capacity.to(torch.int64).view(rows, 1) if isinstance(capacity, Tensor) else capacity
    # Each round: ``used``, the room used up to each item by what is taken and what is a candidate, never decreases
    # (weights are >= 0) and stays within the capacity over the taken items (they fitted), so ``ok = used <= cap`` is
    # true on a prefix that ends at the round's first failure: ``ok.sum`` is its index (``n`` when none), and the
    # candidates inside the prefix are taken (``tc & ok``). The first round's candidates are every item; the next
    # round's, the items lighter than the one that failed (the threshold). No item before a failure that the rounds
    # left out can become one again: it was left out for weighing at least an earlier, larger threshold.
    used = torch.cumsum(w, 1)
    ok = used <= cap
    taken = ok
    for _ in range(distinct_weights):
        # (a gather, not ``w[first]``: an index read on the host is a wait for the device)
        threshold = torch.gather(w_end, 1, ok.sum(1, keepdim=True))
        tc = taken | (w < threshold)
        used = torch.cumsum(w * tc, 1)
        ok = used <= cap
        taken = tc & ok
    return torch.zeros(rows, n, dtype=torch.bool, device=dev).scatter_(1, order, taken)


def knapsack_exact(values: Sequence[float], weights: Sequence[int], capacity: int) -> list[bool]:
    """An exact 0/1 knapsack, ``max Σ v_j I_j s.t. Σ w_j I_j ≤ capacity`` (the paper's Eq. 6), by dynamic
    programming over the Pareto front of (weight, value) selections (Nemhauser–Ullmann). Blocks of one tensor share
    their weight, so the front stays small; values may be any non-negative floats. Ties: the lighter selection, then
    the one found first.

    Example (with weights 6, 5, 5 the greedy takes the value-9 item and then nothing fits, 9 in all; the optimum is
    the two value-8 items, 16):
        >>> knapsack_exact([9, 8, 8], [6, 5, 5], 10), knapsack_greedy([9, 8, 8], [6, 5, 5], 10)
        ([False, True, True], [True, False, False])
    """
    check(len(values) == len(weights), "values", len(values), f"one value per weight ({len(weights)} weights)")
    front: list[tuple[int, float, int]] = [(0, 0.0, 0)]  # (weight, value, bitmask), weight ↑ and value strictly ↑
    for j, (v, w) in enumerate(zip(values, weights)):
        if w > capacity:
            continue
        grown = [(sw + w, sv + float(v), sm | (1 << j)) for sw, sv, sm in front if sw + w <= capacity]
        merged = sorted(front + grown, key=lambda t: (t[0], -t[1]))  # stable: old selections first on ties
        front, best = [], -math.inf
        for state in merged:
            if state[1] > best:
                front.append(state)
                best = state[1]
    mask = front[-1][2]
    return [bool(mask >> j & 1) for j in range(len(values))]


def _check_importance(importance: Tensor, table: BlockTable, param: str = "importance") -> None:
    check(isinstance(importance, Tensor) and importance.shape == (table.num_blocks,), param,
          tuple(importance.shape) if isinstance(importance, Tensor) else importance,
          f"a tensor of shape ({table.num_blocks},), one value per block")


def _check_budget(density: float, table: BlockTable) -> None:
    check_density(density, "density")
    check(density >= table.min_density - 1e-12, "density", density,
          f"a density in [{table.min_density:g}, 1] with split={table.split!r} and B={table.num_splits}: the first "
          f"block of every tensor is always kept, so the real density could not go below {table.min_density:g} "
          f"(the code's s < 1/B case); use split='paper' with s_min <= density, or a larger B")


def select_blocks(importance: Tensor, table: BlockTable, density: float, *, solver: Solver = "greedy",
                  budget: Budget | None = None, s_min: float | None = None) -> Tensor:
    """The binary index ``I*`` (§5.2.3, Eq. 6): which blocks the sparse model keeps under the density budget ``s``.

    The first block of every tensor is always kept (§5.2.2). At ``density = 1`` every block is kept (the code's
    special case, ``gated_learner.py:195``). Otherwise the non-first blocks are chosen by the knapsack:

    * ``budget="group"`` (the code): the linear and the non-linear blocks are solved separately, each with capacity
      ``round(Σ_{non-first j in group} W_j · (s − s_min))`` (computed in float32 like the code's torch ops);
    * ``budget="global"`` (Eq. 6): one knapsack over all blocks with capacity ``⌊s·d⌋ − Σ_{first} W``.

    ``solver="greedy"`` ranks by the integers ``round(10 · G)`` (the code); ``solver="exact"`` maximises ``Σ G``.

    Args:
        importance: ``G``, the block importances ``[L]`` (already clipped at ``s_min``); no gradient is used.
        table: the block split.
        density: the client's budget ``s`` in ``[table.min_density, 1]``.
        solver: ``"greedy"`` (code, default) or ``"exact"`` (paper).
        budget: ``"group"`` or ``"global"``; default: ``"group"`` for the greedy, ``"global"`` for the exact solver.
        s_min: the share subtracted in the ``"group"`` capacity; default the table's ``s_min`` for the paper split,
            else the code's :func:`code_s_min`.

    Returns:
        A bool tensor ``[L]`` on ``importance``'s device.

    Example (LeNet-CIFAR at s = 0.5 keeps 110,910 of 256,830 parameters, s' = 0.432, whatever G is):
        >>> from pl_fedsparse.models import LeNetCIFAR
        >>> with torch.device("meta"):
        ...     t = block_table(LeNetCIFAR())
        >>> keep = select_blocks(torch.full((t.num_blocks,), 0.5), t, 0.5)
        >>> sum(w for w, k in zip(t.sizes, keep.tolist()) if k), round(achieved_density(keep, t), 3)
        (110910, 0.432)
    """
    _check_importance(importance, table)
    _check_budget(density, table)
    check(solver in ("greedy", "exact"), "solver", solver, "'greedy' (the code) or 'exact' (Eq. 6)")
    budget = budget if budget is not None else ("group" if solver == "greedy" else "global")
    check(budget in ("group", "global"), "budget", budget, "'group' (the code), 'global' (Eq. 6) or None")
    keep = list(table.first)
    if density >= 1.0:
        return torch.ones(table.num_blocks, dtype=torch.bool, device=importance.device)
    if solver == "greedy" and (importance.device.type != "cpu" or not HOST_KNAPSACK_ON_CPU):
        return _select_blocks_on_device(importance, table, density, budget, s_min)
    g = importance.detach().double().cpu()
    values: list[float] = (torch.round(g * IMPORTANCE_LEVELS).tolist() if solver == "greedy" else g.tolist())
    solve = knapsack_greedy if solver == "greedy" else knapsack_exact
    if budget == "group":
        if s_min is None:
            s_min = table.s_min if table.s_min is not None else code_s_min(table.num_splits, density)
        _check_s_min(s_min)
        check(s_min <= density, "s_min", s_min, f"a number <= density={density}")
        groups = [[j for j in range(table.num_blocks) if not table.first[j] and table.linear[j] == lin]
                  for lin in (True, False)]
        for items in groups:
            # the code: torch.round(int32_sum * (s - s_min)) in float32
            capacity = _group_capacity(sum(table.sizes[j] for j in items), density, s_min)
            taken = solve([values[j] for j in items], [table.sizes[j] for j in items], capacity)
            for j, t in zip(items, taken):
                keep[j] = t
    else:
        items = [j for j in range(table.num_blocks) if not table.first[j]]
        capacity = math.floor(density * table.numel) - table.kept_numel
        check(capacity >= 0, "density", density,
              f"a density >= {table.kept_numel / table.numel:.6g}, the share of the always-kept first blocks")
        taken = solve([values[j] for j in items], [table.sizes[j] for j in items], capacity)
        for j, t in zip(items, taken):
            keep[j] = t
    return transfer.host_tensor(keep, importance.device, torch.bool)


#: on the CPU, :func:`select_blocks`' greedy runs as a Python scan (faster there than a few dozen tiny tensor ops);
#: off the CPU it always runs on the device (:func:`knapsack_greedy_tensor`). ``False`` takes the device path on the
#: CPU too (the device-traffic counter and the tests do, to count and check what a GPU runs)
HOST_KNAPSACK_ON_CPU = True


def _group_capacity(total: int, density: float, s_min: float) -> int:
    """The code's ``torch.round(int32_sum * (s - s_min))`` in float32 (half to even), without a tensor."""
    return int(np.round(np.float32(np.int32(total)) * np.float32(density - s_min)))


def _knapsack_groups(table: BlockTable, budget: str) -> list[list[int]]:
    """The blocks of each knapsack: linear and convolution blocks apart (``"group"``) or all together
    (``"global"``), the always-kept first blocks left out."""
    if budget == "group":
        return [[j for j in range(table.num_blocks) if not table.first[j] and table.linear[j] == lin]
                for lin in (True, False)]
    return [[j for j in range(table.num_blocks) if not table.first[j]]]


@functools.lru_cache(maxsize=64)
def _device_groups(table: BlockTable, budget: str, device: torch.device) -> tuple[Tensor, Tensor, Tensor, int]:
    """The knapsack groups as rows on ``device`` (made once per table and device): the first blocks' mask
    ``[num_blocks]``, each group's block indices ``[G, n]`` and weights ``[G, n]`` — shorter groups padded with a
    first block's index (always kept: what a padding item is given is overwritten by ``first``) and weight 0 (never
    changes a selection) — and the largest number of distinct weights of a group."""
    groups = _knapsack_groups(table, budget)
    width = max(len(items) for items in groups)
    pad = table.first.index(True) if any(table.first) else 0  # (every tensor has a first block)
    index = [items + [pad] * (width - len(items)) for items in groups]
    sizes = [[table.sizes[j] for j in items] + [0] * (width - len(items)) for items in groups]
    distinct = max(len({table.sizes[j] for j in items}) for items in groups)
    return (transfer.host_tensor(table.first, device, torch.bool), transfer.host_tensor(index, device, torch.int64),
            transfer.host_tensor(sizes, device, torch.int64), distinct)


@functools.lru_cache(maxsize=256)
def _device_capacities(table: BlockTable, budget: str, density: float, s_min: float | None,
                       device: torch.device) -> Tensor:
    """Each knapsack group's capacity ``[G]`` on ``device`` (made once per table, budget, density and device)."""
    if budget == "group":
        caps = [_group_capacity(sum(table.sizes[j] for j in items), density, s_min)  # type: ignore[arg-type]
                for items in _knapsack_groups(table, budget)]
    else:
        caps = [math.floor(density * table.numel) - table.kept_numel]
    return transfer.host_tensor(caps, device, torch.int64)


@functools.lru_cache(maxsize=64)
def block_span_tensors(table: BlockTable, device: torch.device) -> tuple[Tensor, Tensor]:
    """``(tensor_of_block, sizes)`` on ``device``: per block, the index of its tensor in ``table.names`` and its number
    of elements (int64) — to sum kept elements per tensor where the index is (``index_add_``), made once per table
    and device.

    Example:
        >>> t = make_block_table([("a", (4,), True), ("b", (2,), False)], num_splits=2)
        >>> [x.tolist() for x in block_span_tensors(t, torch.device("cpu"))]
        [[0, 0, 1, 1], [2, 2, 1, 1]]
    """
    owner = [i for i, (b, e) in enumerate(table.spans) for _ in range(b, e)]
    return transfer.host_tensor(owner, device, torch.int64), transfer.host_tensor(table.sizes, device, torch.int64)


def _select_blocks_on_device(importance: Tensor, table: BlockTable, density: float, budget: str,
                             s_min: float | None) -> Tensor:
    """:func:`select_blocks`' greedy on ``importance``'s device: every group's knapsack at once
    (:func:`knapsack_greedy_rows`)."""
    g = importance.detach().double()
    values = torch.round(g * IMPORTANCE_LEVELS)
    if budget == "group":
        if s_min is None:
            s_min = table.s_min if table.s_min is not None else code_s_min(table.num_splits, density)
        _check_s_min(s_min)
        check(s_min <= density, "s_min", s_min, f"a number <= density={density}")
    first, index, sizes, distinct = _device_groups(table, budget, importance.device)
    if index.numel() == 0:
        return first.clone()
    if budget != "group":
        check(math.floor(density * table.numel) - table.kept_numel >= 0, "density", density,
              f"a density >= {table.kept_numel / table.numel:.6g}, the share of the always-kept first blocks")
    capacity = _device_capacities(table, budget, density, s_min if budget == "group" else None, importance.device)
    taken = knapsack_greedy_rows(values[index], sizes, capacity, distinct)
    return first.scatter(0, index.flatten(), taken.flatten()) | first  # (padding wrote to a first block)


def straight_through(keep: Tensor, importance: Tensor, *, variant: Variant = "paper") -> Tensor:
    """The straight-through index ``I_ST``: forward value ``I*``, gradient routed to ``G`` (App. A).

    ``"paper"``: ``I_ST = I* − G.detach() + G`` (every block passes gradient to its ``G_j``).
    ``"code"``: ``(1 − G.detach() + G) · I*`` (``gated_learner.py:204-225``; a dropped block passes none).

    Example:
        >>> g = torch.tensor([0.3, 0.6], requires_grad=True)
        >>> i = straight_through(torch.tensor([True, False]), g)
        >>> i.detach().tolist(), torch.autograd.grad(i.sum(), g)[0].tolist()
        ([1.0, 0.0], [1.0, 1.0])
    """
    check(variant in ("paper", "code"), "variant", variant, "'paper' (App. A) or 'code'")
    check(keep.shape == importance.shape, "keep", tuple(keep.shape), f"the importance's shape {tuple(importance.shape)}")
    k = keep.to(importance.dtype)
    if variant == "paper":
        return k - importance.detach() + importance
    return (1.0 - importance.detach() + importance) * k


def sparse_gated_weights(weights: Tensor, importance: Tensor, keep: Tensor | None, *,
                         variant: Variant = "paper") -> Tensor:
    """The sparse gated weights ``M' = I_ST ⊙ M`` (§5.2.3 and App. A).

    Args:
        weights: ``M``, the gated weights ``[L]``.
        importance: ``G``, the (clipped) importances ``[L]``.
        keep: ``I*`` from :func:`select_blocks`, or ``None`` for the dense case ``s = 1``: the code variant then
            returns ``M`` itself (no straight-through term, so ``G`` gets no gradient, ``gated_learner.py:195``); the
            paper variant uses ``I* = 1``.
        variant: ``"paper"`` (default) or ``"code"``, see :func:`straight_through`.

    Example:
        >>> m = torch.tensor([0.5, 0.8]); g = torch.tensor([0.3, 0.6])
        >>> sparse_gated_weights(m, g, torch.tensor([True, False])).tolist()
        [0.5, 0.0]
    """
    check(weights.shape == importance.shape, "weights", tuple(weights.shape),
          f"the importance's shape {tuple(importance.shape)}")
    if keep is None:
        if variant == "code":
            return weights
        keep = torch.ones_like(importance, dtype=torch.bool)
    return straight_through(keep, importance, variant=variant) * weights


def adapt_gated_weights(importance: Tensor, weights: Tensor, table: BlockTable, density: float, *,
                        solver: Solver = "greedy", budget: Budget | None = None, variant: Variant = "paper",
                        s_min: float | None = None) -> tuple[Tensor, Tensor]:
    """One batch's sparse gated weights: ``I* = knapsack(G)`` then ``M' = I_ST ⊙ M`` (Alg. 1 line 3).

    Returns:
        ``(M', I*)``: the sparse gated weights ``[L]`` (differentiable in ``G`` and ``M``) and the bool index ``[L]``.
        At ``density = 1`` every block is kept (for the code variant ``M' = M``).

    Example:
        >>> t = make_block_table([("w", (10,), True)], num_splits=5)
        >>> m, keep = adapt_gated_weights(torch.tensor([.2, .9, .2, .7, .3]), torch.full((5,), .5), t, 0.6,
        ...                               budget="global")
        >>> keep.tolist(), m.tolist()
        ([True, True, False, True, False], [0.5, 0.5, 0.0, 0.5, 0.0])
    """
    _check_importance(importance, table)
    _check_importance(weights, table, "weights")
    if density >= 1.0:
        _check_budget(density, table)
        return (sparse_gated_weights(weights, importance, None, variant=variant),
                torch.ones(table.num_blocks, dtype=torch.bool, device=importance.device))
    keep = select_blocks(importance, table, density, solver=solver, budget=budget, s_min=s_min)
    return sparse_gated_weights(weights, importance, keep, variant=variant), keep


def expand_block_weights(block_weights: Tensor, table: BlockTable, index: int) -> Tensor:
    """The per-element scale of parameter ``index``: ``block_weights[j]`` repeated over block ``j``'s elements,
    shaped like the parameter (the code's ``adapt_prune_model`` mask).

    Example:
        >>> t = make_block_table([("w", (2, 3), True)], num_splits=3)
        >>> expand_block_weights(torch.tensor([1., 2., 3.]), t, 0)
        tensor([[1., 1., 2.],
                [2., 3., 3.]])
    """
    begin, end = table.spans[index]
    first, rest = block_weights[begin:begin + 1], block_weights[begin + 1:end] if end - begin > 1 else None
    return _expand_pieces(first, rest, table, index)


def _expand_pieces(first: Tensor, rest: Tensor | None, table: BlockTable, index: int) -> Tensor:
    """:func:`expand_block_weights` of parameter ``index`` from its first block's weight ``[..., 1]`` and its other
    blocks' ``[..., n − 1]`` (``None`` for a single block); leading dimensions (stacked clients) are kept."""
    numel = math.prod(table.shapes[index])
    head = table.sizes[table.spans[index][0]]
    lead = first.shape[:-1]
    if rest is None:
        return first.expand(*lead, head).contiguous().view(*lead, *table.shapes[index])
    size = table.sizes[table.spans[index][0] + 1]  # every later block has this size except a shorter last one
    # the shorter last block is cut off after the concatenation, not before: the same values and gradients bit for
    # bit, and inductor's C++ backend (torch 2.14.1) miscompiles a cut repeat inside a concatenation: its loop split
    # (CppScheduling.try_loop_split) cuts the 819 elements of 4 blocks of 205 into 3 x 205 and leaves the last,
    # partial block unwritten (garbage weights under trainer.compile on a CPU; tests/test_compile.py)
    whole = torch.cat([first.expand(*lead, head), rest.repeat_interleave(size, dim=-1)], -1)
    return whole[..., :numel].view(*lead, *table.shapes[index])


@functools.lru_cache(maxsize=64)
def _piece_sizes(table: BlockTable) -> tuple[tuple[int, ...], tuple[tuple[int, int | None], ...]]:
    """``M'`` cut into every parameter's first block and its other blocks, in block order: the pieces' lengths, and
    per parameter the index of its first piece and of its rest (``None`` for a single block)."""
    sizes: list[int] = []
    where: list[tuple[int, int | None]] = []
    for begin, end in table.spans:
        sizes.append(1)
        if end - begin > 1:
            sizes.append(end - begin - 1)
            where.append((len(sizes) - 2, len(sizes) - 1))
        else:
            where.append((len(sizes) - 1, None))
    return tuple(sizes), tuple(where)


def personalized_params(params: Mapping[str, Tensor], block_weights: Tensor, table: BlockTable) -> dict[str, Tensor]:
    """The personalised sparse parameters ``θ' = θ ⊙ expand(M')`` (§5.1 "θ' = θ_g ⊛ M'", Alg. 1 line 4), new tensors
    for ``torch.func.functional_call``; ``θ`` is never written. Gradients reach both ``θ`` (``expand(M') ⊙ ∂L/∂θ'``,
    exactly 0 in dropped blocks) and ``M'``. The scale is cast to each parameter's dtype.

    Args:
        params: the global parameters by name (e.g. ``dict(model.named_parameters())``); every table name must be
            present, extra entries are ignored.
        block_weights: ``M'`` ``[L]``.
        table: the block split.

    Example:
        >>> t = make_block_table([("w", (4,), True)], num_splits=2)
        >>> personalized_params({"w": torch.ones(4)}, torch.tensor([0.5, 0.0]), t)
        {'w': tensor([0.5000, 0.5000, 0.0000, 0.0000])}
    """
    _check_importance(block_weights, table, "block_weights")
    missing = [n for n in table.names if n not in params]
    check(not missing, "params", missing[:3], "a mapping with every parameter of the block table")
    # one split of M' for every parameter (its backward: one concatenation, where slicing per parameter costs a
    # zero-filled copy of M' per slice and the sum of them all; on a GPU each is a kernel launch)
    sizes, where = _piece_sizes(table)
    pieces = torch.split(block_weights, list(sizes))
    out = {}
    for i, name in enumerate(table.names):
        theta = params[name]
        check(tuple(theta.shape) == table.shapes[i], f"params[{name!r}]", tuple(theta.shape),
              f"the block table's shape {table.shapes[i]}")
        first, rest = where[i]
        scale = _expand_pieces(pieces[first], None if rest is None else pieces[rest], table, i)
        out[name] = theta * scale.to(theta.dtype)
    return out


def achieved_density(keep: Tensor, table: BlockTable) -> float:
    """The achieved density ``s' = |I*·W| / d``: the share of parameters in kept blocks, first blocks included (the
    paper's s' = 0.43 / 0.25; the code's logged ``sparse_ratio_selected`` leaves the first blocks out).

    Example:
        >>> t = make_block_table([("w", (10,), True)], num_splits=5)
        >>> achieved_density(torch.tensor([True, False, True, False, False]), t)
        0.4
    """
    check(keep.shape == (table.num_blocks,), "keep", tuple(keep.shape), f"a tensor of shape ({table.num_blocks},)")
    return sum(w for w, k in zip(table.sizes, keep.tolist()) if k) / table.numel
