"""pFedGate's batch step for many clients at once: every tensor with a leading client dimension ``K``, so that a
round's clients run the gating layer, the knapsack, the straight-through estimator and the expansion of ``θ'`` in one
set of operations instead of one per client (Chen et al., ICML 2023, Alg. 1 lines 3-4; what
:meth:`~pl_fedsparse.callbacks.PFedGate._gated_forward` does for one client).

Row ``k`` of every result is what the one-client function gives on row ``k`` of the inputs:

* :func:`stacked_gate_forward` — :class:`~pl_fedsparse.models.gate.GatingLayer`'s forward from the clients'
  stacked gate states (its ``state_dict`` entries, ``[K, *shape]``), updating the stacked running statistics in
  place in training mode. The linear layers accumulate as ``addmm`` does (``baddbmm``) and the post-norm
  ``BatchNorm1d`` of the ``K`` clients is one ``batch_norm`` over ``K·L`` channels (a channel's statistics are its own
  client's), so the clients' results are their own to rounding (on the CPU, bit for bit: tested);
* :func:`stacked_select_blocks` — :func:`~pl_fedsparse.functional.gate.select_blocks`' greedy for every client (and
  knapsack group) as rows of one :func:`~pl_fedsparse.functional.gate.knapsack_greedy_rows`, each client with its own
  density;
* :func:`stacked_personalized_params` — ``θ' = θ ⊙ expand(M')`` for stacked ``θ`` and ``M'``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from pl_fedsparse.functional import transfer
from pl_fedsparse.functional.gate import (
    IMPORTANCE_LEVELS,
    BlockTable,
    _device_capacities,
    _device_groups,
    _expand_pieces,
    _piece_sizes,
    code_s_min,
    knapsack_greedy_rows,
)

__all__ = ["stacked_capacities", "stacked_gate_forward", "stacked_personalized_params", "stacked_select_blocks",
           "stacked_straight_through"]


class _Ragged:
    """Clients' batches of different sizes in one stack: ``x`` padded to the longest, ``mask`` ``[K, B]`` (1 on a
    client's own samples), ``n`` ``[K]`` their counts, ``train`` ``[K]`` bool (rows of one sample run in eval mode,
    as a lone client's gate does: BatchNorm1d needs two)."""

    def __init__(self, sizes: Sequence[int], batch: int, device: torch.device) -> None:
        n = transfer.host_tensor(list(sizes), device)
        self.mask = (torch.arange(batch, device=device).view(1, -1) < n.view(-1, 1)).float()
        self.n = n.float()
        self.count = n
        self.train = n >= 2

    def mean(self, t: Tensor) -> Tensor:
        """The mean over each row's own samples (dimension 1) of ``t`` ``[K, B, ...]``, keeping the dimension."""
        shape = (t.shape[0], t.shape[1], *([1] * (t.dim() - 2)))
        return (t * self.mask.view(shape)).sum(1, keepdim=True) / self.n.view(-1, *([1] * (t.dim() - 1)))

    def rows(self, t: Tensor) -> Tensor:
        """``train`` shaped to broadcast over ``t`` ``[K, ...]``."""
        return self.train.view(-1, *([1] * (t.dim() - 1)))


def _switch_norm(x: Tensor, s: Mapping[str, Tensor], prefix: str, training: bool, momentum: float,
                 eps: float, ragged: _Ragged | None = None) -> Tensor:
    """:class:`~pl_fedsparse.models.gate.SwitchNorm2d` on ``x`` ``[K, B, C, H, W]`` (its operations, one client
    dimension ahead; with ``ragged``, the batch statistics over each client's own samples)."""
    k, n, c, h, w = x.shape
    flat = x.reshape(k, n, c, h * w)
    mean_in = flat.mean(-1, keepdim=True)
    var_in = flat.var(-1, keepdim=True)  # unbiased, as the official SN code
    second = var_in + mean_in ** 2
    mean_ln = mean_in.mean(2, keepdim=True)
    var_ln = second.mean(2, keepdim=True) - mean_ln ** 2
    running_mean, running_var = s[prefix + "running_mean"], s[prefix + "running_var"]  # [K, 1, C, 1]
    if ragged is not None:  # each row's own samples; rows of one sample on the running statistics
        batch_mean = ragged.mean(mean_in)
        batch_var = ragged.mean(second) - batch_mean ** 2
        train = ragged.rows(running_mean)
        with torch.no_grad():
            running_mean.copy_(torch.where(train, running_mean * momentum + (1 - momentum) * batch_mean,
                                           running_mean))
            running_var.copy_(torch.where(train, running_var * momentum + (1 - momentum) * batch_var, running_var))
        mean_bn = torch.where(train, batch_mean, running_mean)
        var_bn = torch.where(train, batch_var, running_var)
    elif training:
        mean_bn = mean_in.mean(1, keepdim=True)
        var_bn = second.mean(1, keepdim=True) - mean_bn ** 2
        with torch.no_grad():
            running_mean.mul_(momentum).add_((1 - momentum) * mean_bn)
            running_var.mul_(momentum).add_((1 - momentum) * var_bn)
    else:
        mean_bn, var_bn = running_mean, running_var
    mw = torch.softmax(s[prefix + "mean_weight"], 1).view(k, 3, 1, 1, 1)
    vw = torch.softmax(s[prefix + "var_weight"], 1).view(k, 3, 1, 1, 1)
    mean = mw[:, 0] * mean_in + mw[:, 1] * mean_ln + mw[:, 2] * mean_bn
    var = vw[:, 0] * var_in + vw[:, 1] * var_ln + vw[:, 2] * var_bn
    out = ((flat - mean) / (var + eps).sqrt()).view(k, n, c, h, w)
    return out * s[prefix + "weight"] + s[prefix + "bias"]  # ([K, 1, C, 1, 1]: one client dimension ahead)


def _gate_path(z: Tensor, s: Mapping[str, Tensor], prefix: str, training: bool,
               ragged: _Ragged | None = None) -> Tensor:
    """``Flatten → Linear → BatchNorm1d`` of one gate path on ``z`` ``[K, B, d_X]``, then the sigmoid's batch mean
    ``[K, L]``."""
    k, n, _ = z.shape
    weight, bias = s[prefix + "1.weight"], s[prefix + "1.bias"]  # [K, L, d_X], [K, L]
    out = torch.baddbmm(bias.unsqueeze(1), z, weight.transpose(1, 2))  # (addmm's accumulation, per client)
    num_blocks = out.shape[-1]
    if ragged is not None:  # BatchNorm1d's arithmetic over each row's own samples (F.batch_norm's, written out)
        running_mean, running_var = s[prefix + "2.running_mean"], s[prefix + "2.running_var"]  # [K, L]
        mean = ragged.mean(out)  # [K, 1, L]
        var = ragged.mean((out - mean) ** 2)
        train = ragged.rows(running_mean)
        with torch.no_grad():
            unbiased = var.squeeze(1) * (ragged.n / (ragged.n - 1).clamp(min=1)).view(-1, 1)
            running_mean.copy_(torch.where(train, 0.1 * mean.squeeze(1) + 0.9 * running_mean, running_mean))
            running_var.copy_(torch.where(train, 0.1 * unbiased + 0.9 * running_var, running_var))
            s[prefix + "2.num_batches_tracked"].add_(ragged.train.to(s[prefix + "2.num_batches_tracked"].dtype))
        mean = torch.where(train.unsqueeze(1), mean, running_mean.unsqueeze(1))
        var = torch.where(train.unsqueeze(1), var, running_var.unsqueeze(1))
        normed = (out - mean) * torch.rsqrt(var + 1e-5) * s[prefix + "2.weight"].unsqueeze(1) \
            + s[prefix + "2.bias"].unsqueeze(1)
        return ragged.mean(torch.sigmoid(normed)).squeeze(1)
    # BatchNorm1d of every client as channels of one: [B, K·L] (a channel's statistics are its own client's)
    if training:
        with torch.no_grad():
            s[prefix + "2.num_batches_tracked"].add_(1)
    normed = F.batch_norm(out.transpose(0, 1).reshape(n, k * num_blocks), s[prefix + "2.running_mean"].view(-1),
                          s[prefix + "2.running_var"].view(-1), s[prefix + "2.weight"].reshape(-1),
                          s[prefix + "2.bias"].reshape(-1), training, 0.1, 1e-5)
    # the batch mean over each client's own contiguous [B, L] block: the reduction one client's makes (a mean over
    # the rows of [B, K·L] sums in another order on the CPU)
    return torch.sigmoid(normed).view(n, k, num_blocks).transpose(0, 1).contiguous().mean(1)


def stacked_gate_forward(state: Mapping[str, Tensor], x: Tensor, s_min: Tensor | float | None, *,
                         training: bool, separate_paths: bool, momentum: float = 0.9, eps: float = 1e-5,
                         sizes: Sequence[int] | None = None) -> tuple[Tensor, Tensor]:
    """``(G, M)`` ``[K, L]`` of ``K`` clients' gating layers, each on its own batch.

    Args:
        state: the clients' gate ``state_dict`` entries stacked ``[K, *shape]`` (parameters may require gradients;
            the running statistics are updated in place in training mode, as each client's module would update its
            own; ``gating.2.num_batches_tracked`` counts the batch).
        x: ``[K, B, C, H, W]``, client ``k``'s batch in row ``k``.
        s_min: the clip floor of ``G``: one for every client, ``[K]`` one each, or ``None`` (unclipped).
        training: the gates' mode (BatchNorm's and SwitchNorm's batch statistics, or their running ones).
        separate_paths: whether ``M`` comes from its own path (``w_transform.*``) or is the scores.
        momentum: SwitchNorm's running statistics' decay (the module's 0.9).
        eps: SwitchNorm's ``eps``.
        sizes: the clients' own batch sizes when they differ (``x`` padded after each client's samples to the
            longest): every statistic over the batch is then taken over a client's own samples (a written-out
            BatchNorm, the same to rounding), and a client with one sample runs in eval mode (its running statistics
            used, not moved: what a lone gate does with a batch of one). Requires ``training``.
    """
    with torch.autocast(device_type=x.device.type, enabled=False):
        k = x.shape[0]
        ragged = None if sizes is None else _Ragged(sizes, int(x.shape[1]), x.device)
        z = _switch_norm(x.float(), state, "norm_input.", training, momentum, eps, ragged).reshape(k, x.shape[1], -1)
        scores = _gate_path(z, state, "gating.", training, ragged)
        weights = _gate_path(z, state, "w_transform.", training, ragged) if separate_paths else scores
        if s_min is None:
            importance = scores
        elif isinstance(s_min, Tensor):
            importance = torch.maximum(scores, s_min.to(scores.dtype).view(k, 1))
        else:
            importance = torch.clamp(scores, min=float(s_min))
    return importance, weights


@functools.lru_cache(maxsize=64)
def _stacked_capacities(table: BlockTable, budget: str, densities: tuple[float, ...], s_mins: tuple[float, ...],
                        device: torch.device) -> Tensor:
    """Every client's knapsack capacities, ``[K, G]`` (made once per set of budgets)."""
    return torch.stack([_device_capacities(table, budget, d, m if budget == "group" else None, device)
                        for d, m in zip(densities, s_mins, strict=True)])


def stacked_capacities(table: BlockTable, densities: Sequence[float], budget: str = "group",
                       s_mins: Sequence[float] | None = None, device: torch.device | str = "cpu") -> Tensor:
    """Every client's knapsack capacities ``[K, G]`` for :func:`stacked_select_blocks` (a dense client's are any
    budget's: its selection is overridden). Made once per set of budgets and device.

    Args:
        table: the block split.
        densities: each client's budget ``s``.
        budget: ``"group"`` (the code) or ``"global"`` (Eq. 6).
        s_mins: the ``"group"`` capacity's share per client (default: the table's ``s_min``, else the code's
            :func:`~pl_fedsparse.functional.gate.code_s_min` of the client's density).
        device: where the capacities are used.
    """
    if s_mins is None:
        s_mins = [table.s_min if table.s_min is not None else code_s_min(table.num_splits, d) for d in densities]
    solvable = [min(d, 0.999999) for d in densities]
    return _stacked_capacities(table, budget, tuple(solvable),
                               tuple(min(m, d) for m, d in zip(s_mins, solvable, strict=True)), torch.device(device))


def stacked_select_blocks(importance: Tensor, table: BlockTable, densities: Sequence[float],
                          budget: str = "group", s_mins: Sequence[float] | None = None,
                          capacity: Tensor | None = None) -> Tensor:
    """The greedy's ``I*`` ``[K, L]`` of every client (row ``k``: ``select_blocks(importance[k], table,
    densities[k], solver="greedy", budget=budget)``), all knapsacks as rows of one, no host synchronisation. A client
    with density 1 keeps every block.

    Args:
        importance: ``G`` ``[K, L]`` (no gradient is used).
        table: the block split.
        densities: each client's budget ``s``.
        budget: ``"group"`` (the code) or ``"global"`` (Eq. 6).
        s_mins: the ``"group"`` capacity's share per client (default: the table's ``s_min``, else the code's
            :func:`~pl_fedsparse.functional.gate.code_s_min` of the client's density).
        capacity: :func:`stacked_capacities` of these clients, made ahead (default: made here).
    """
    k, num_blocks = importance.shape
    dev = importance.device
    first, index, sizes, distinct = _device_groups(table, budget, dev)
    dense = [d >= 1.0 for d in densities]
    if index.numel() == 0 or all(dense):
        keep = first.expand(k, num_blocks).clone()
        return keep | transfer.host_tensor(dense, dev).view(k, 1) if any(dense) else keep
    if capacity is None:  # (a dense client's rows are solved at any budget and then overridden: one shape for all)
        capacity = stacked_capacities(table, densities, budget, s_mins, dev)
    values = torch.round(importance.detach().double() * IMPORTANCE_LEVELS)
    groups, width = index.shape
    picked = values[:, index].reshape(k * groups, width)
    taken = knapsack_greedy_rows(picked, sizes.repeat(k, 1), capacity.reshape(-1), distinct)
    keep = first.expand(k, num_blocks).clone().scatter_(1, index.flatten().expand(k, -1), taken.view(k, -1))
    keep |= first  # (padding wrote to a first block)
    if any(dense):
        keep |= transfer.host_tensor(dense, dev).view(k, 1)
    return keep


def stacked_straight_through(keep: Tensor, importance: Tensor, weights: Tensor, variant: str = "paper",
                             dense: Tensor | None = None) -> Tensor:
    """``M' = I_ST ⊙ M`` ``[K, L]`` (:func:`~pl_fedsparse.functional.gate.sparse_gated_weights` per row). ``dense``
    ``[K]`` bool marks clients at density 1, whose ``"code"`` variant is ``M`` itself."""
    k = keep.to(importance.dtype)
    if variant == "paper":
        return (k - importance.detach() + importance) * weights
    out = (1.0 - importance.detach() + importance) * k * weights
    return out if dense is None else torch.where(dense.view(-1, 1), weights, out)


def stacked_personalized_params(params: Mapping[str, Tensor], block_weights: Tensor,
                                table: BlockTable) -> dict[str, Tensor]:
    """``θ' = θ ⊙ expand(M')`` for stacked ``θ`` (``[K, *shape]`` by name) and ``M'`` ``[K, L]``
    (:func:`~pl_fedsparse.functional.gate.personalized_params` per row, through its own expansion)."""
    sizes, where = _piece_sizes(table)
    pieces = torch.split(block_weights, list(sizes), dim=1)
    out = {}
    for i, name in enumerate(table.names):
        theta = params[name]
        first, rest = where[i]
        scale = _expand_pieces(pieces[first], None if rest is None else pieces[rest], table, i)
        out[name] = theta * scale.to(theta.dtype)
    return out
