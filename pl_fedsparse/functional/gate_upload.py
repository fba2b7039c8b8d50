"""pFedGate's uploads and the paper's index-wise aggregation, block by block (Chen et al., "Efficient Personalized
Federated Learning via Sparse Model-Adaptation", ICML 2023, arXiv 2305.02776, App. A "Global Model Aggregation" and
§6.3's upload ratio q_i; the authors' code ``yxdyc/pFedGate@b8cfa156`` averages dense state dicts instead,
``gate_aggregator.py``).

After a round, a client has trained the global model under a different sparse mask on every batch; the blocks it
selected on at least one batch (the *union*, the author's answer in ``yxdyc/pFedGate#1``) are where its update can be
non-zero. The paper's client uploads only those blocks, "the nonzero parameter updates with their corresponding
index"; the server averages every index over the clients that sent it ("δ0 from clients 1, 3 and 4"). On the wire
that is the values of the kept blocks plus one bit per block (:func:`pack_blocks`): the receiver rebuilds the dense
tensors from the shared :class:`~pl_fedsparse.functional.gate.BlockTable` (:func:`unpack_blocks`).

Pure tensor maths; the federation wiring is :class:`pl_fedsparse.callbacks.PFedGate`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch  # noqa: F401 (the examples use it)
from torch import Tensor

from pl_fedsparse.errors import check
from pl_fedsparse.functional.aggregation import masked_weighted_average
from pl_fedsparse.functional.gate import BlockTable, expand_block_weights
from pl_fedsparse.functional.sparse import expand_values

__all__ = ["block_masks", "index_wise_average", "kept_numel", "pack_blocks", "unpack_blocks"]


def _check_keep(keep: Tensor, table: BlockTable) -> None:
    check(isinstance(keep, Tensor) and keep.shape == (table.num_blocks,), "keep",
          tuple(keep.shape) if isinstance(keep, Tensor) else keep, f"a bool tensor of shape ({table.num_blocks},)")


def block_masks(keep: Tensor, table: BlockTable) -> dict[str, Tensor]:
    """Element masks of the kept blocks, one bool tensor per parameter (shaped like it, on ``keep``'s device).

    Example (a 10-element tensor in blocks of 2; blocks 0 and 3 kept):
        >>> from pl_fedsparse.functional.gate import make_block_table
        >>> t = make_block_table([("w", (10,), True)], num_splits=5)
        >>> block_masks(torch.tensor([True, False, False, True, False]), t)["w"].int().tolist()
        [1, 1, 0, 0, 0, 0, 1, 1, 0, 0]
    """
    _check_keep(keep, table)
    k = keep.detach().float()  # (made where ``keep`` is: a server aggregating on the device reads no value here)
    return {name: expand_block_weights(k, table, i) > 0 for i, name in enumerate(table.names)}


def kept_numel(keep: Tensor, table: BlockTable) -> int:
    """Elements in the kept blocks, ``|I·W|``.

    Example (7 elements in blocks of 3, 3, 1):
        >>> from pl_fedsparse.functional.gate import make_block_table
        >>> kept_numel(torch.tensor([True, False, True]), make_block_table([("w", (7,), True)], num_splits=3))
        4
    """
    _check_keep(keep, table)
    return sum(w for w, k in zip(table.sizes, keep.tolist()) if k)


def pack_blocks(tensors: Mapping[str, Tensor], keep: Tensor, table: BlockTable) -> dict[str, Tensor]:
    """The values of the kept blocks of every parameter, as one flat tensor per parameter (row-major order): what
    travels besides the ``L``-bit block index.

    Example:
        >>> from pl_fedsparse.functional.gate import make_block_table
        >>> t = make_block_table([("w", (2, 3), True)], num_splits=3)  # blocks [0, 1], [2, 3], [4, 5]
        >>> pack_blocks({"w": torch.arange(6.0).view(2, 3)}, torch.tensor([True, False, True]), t)
        {'w': tensor([0., 1., 4., 5.])}
    """
    masks = block_masks(keep, table)
    missing = [n for n in table.names if n not in tensors]
    check(not missing, "tensors", missing[:3], "a mapping with every parameter of the block table")
    return {n: tensors[n].detach().flatten()[masks[n].flatten().to(tensors[n].device)] for n in table.names}


def unpack_blocks(values: Mapping[str, Tensor], keep: Tensor, table: BlockTable) -> dict[str, Tensor]:
    """Dense tensors from :func:`pack_blocks`' values: the kept blocks filled, zeros elsewhere.

    Example:
        >>> from pl_fedsparse.functional.gate import make_block_table
        >>> t = make_block_table([("w", (2, 3), True)], num_splits=3)
        >>> unpack_blocks({"w": torch.tensor([0., 1., 4., 5.])}, torch.tensor([True, False, True]), t)["w"]
        tensor([[0., 1., 0.],
                [0., 4., 5.]])
    """
    masks = block_masks(keep, table)
    out = {}
    for n in table.names:  # (each mask is shaped like its parameter)
        out[n] = expand_values(values[n].flatten(), masks[n], param=f"values[{n!r}]")
    return out


def index_wise_average(deltas: Sequence[Mapping[str, Tensor]], keeps: Sequence[Tensor], weights: Sequence[float],
                       table: BlockTable) -> dict[str, Tensor]:
    """The paper's index-wise aggregation (App. A): every element is the weighted mean of the updates of the clients
    whose uploaded blocks contain it, and 0 where nobody sent it (the global value stays):
    ``Δ_k = Σ_{i: k ∈ U_i} n_i Δ_{i,k} / Σ_{i: k ∈ U_i} n_i``. A sent element whose update is 0 still counts (unlike
    the element-wise rule EWA, which tests ``Δ ≠ 0``).

    Args:
        deltas: one dense update per client (by parameter name; at least the table's tensors).
        keeps: one bool ``[L]`` block index per client, the union ``U_i`` of the blocks it selected.
        weights: one weight per client (its training samples).
        table: the block split.

    Example (the paper's toy case: three one-element blocks; clients 1, 3, 4 sent block 0, weights 1, 1, 1, 2):
        >>> from pl_fedsparse.functional.gate import make_block_table
        >>> t = make_block_table([("w", (3,), True)], num_splits=3)
        >>> d = [{"w": torch.tensor([1., 9., 2.])}, {"w": torch.tensor([9., 4., 4.])},
        ...      {"w": torch.tensor([3., 6., 9.])}, {"w": torch.tensor([4., 0., 6.])}]
        >>> k = [torch.tensor(x) for x in ([1, 0, 1], [0, 1, 1], [1, 1, 0], [1, 1, 1])]
        >>> index_wise_average(d, [m.bool() for m in k], [1, 1, 1, 2], t)["w"].tolist()
        [3.0, 2.5, 4.5]
    """
    check(len(deltas) == len(keeps) == len(weights) and len(deltas) > 0, "deltas", len(deltas),
          f"a non-empty list with one block index and one weight each ({len(keeps)}, {len(weights)})")
    masks = [block_masks(k, table) for k in keeps]
    return {n: masked_weighted_average([d[n] for d in deltas], list(weights), [m[n] for m in masks])
            for n in table.names}
