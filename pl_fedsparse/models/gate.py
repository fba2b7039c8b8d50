"""pFedGate's gating layer φ (Chen et al., ICML 2023, §5.2.1 and Fig. 2; the code's ``GatingLayer``,
``models/gating_layers.py:25-154``, with ``SwitchNorm2d`` from ``models/switchable_norm.py:64-142`` and the batch
mean of ``gated_learner.py:82-116``), and the functional forward of the sparse personalised model.

Unlike the backbones of this package, these modules hold buffers (SwitchNorm's and BatchNorm's running statistics):
they are client state, never aggregated. The block maths (split, knapsack, straight-through, ``θ'``) is in
:mod:`pl_fedsparse.functional.gate`.

A batch step, as Alg. 1 lines 3-4 (the federation wiring lives in a callback)::

    table = block_table(model)                                   # L blocks, W look-up table
    gate = GatingLayer(table.num_blocks, in_channels=3, input_size=32)
    G, M = gate(x, s_min=code_s_min(table.num_splits, s))         # [L] each, float32
    M_sparse, keep = adapt_gated_weights(G, M, table, s)          # knapsack + straight-through
    logits = adapted_forward(model, personalized_params(dict(model.named_parameters()), M_sparse, table), x)
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pl_fedsparse.errors import check

__all__ = ["GatingLayer", "SwitchNorm2d", "adapted_forward"]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _side_pair(input_size: object) -> tuple[int, int] | None:
    """``(H, W)`` from an int side or a pair, or ``None`` when invalid (H·W must be >= 2)."""
    pair = (input_size, input_size) if _is_int(input_size) else input_size
    if not (isinstance(pair, Sequence) and len(pair) == 2 and all(_is_int(v) and v >= 1 for v in pair)):
        return None
    h, w = int(pair[0]), int(pair[1])
    return (h, w) if h * w >= 2 else None


class SwitchNorm2d(nn.Module):
    """Switchable normalisation (Luo et al., ICLR 2019) over ``[N, C, H, W]``, configured as pFedGate's code uses it
    (the official SN implementation with ``using_bn=True``, ``using_moving_average=True``, ``last_gamma=False``).

    The output is ``(x − μ) / sqrt(σ² + eps) · γ + β`` with ``μ = Σ_k softmax(mean_weight)_k μ_k`` and
    ``σ² = Σ_k softmax(var_weight)_k σ²_k`` over k ∈ {IN, LN, BN}:

    * IN: per sample and channel over H·W, with the **unbiased** variance;
    * LN: ``μ_LN = mean_C μ_IN``, ``σ²_LN = mean_C(σ²_IN + μ_IN²) − μ_LN²``;
    * BN (training): ``μ_BN = mean_N μ_IN``, ``σ²_BN = mean_N(σ²_IN + μ_IN²) − μ_BN²``; the running statistics start at
      **zero** and move as ``running = momentum · running + (1 − momentum) · batch`` (momentum 0.9, the opposite
      convention of ``nn.BatchNorm``); in eval mode BN uses them while IN and LN are still computed from the input.

    Trainable: ``γ`` (ones) and ``β`` (zeros), shaped ``[1, C, 1, 1]``, and the mixing logits ``mean_weight`` and
    ``var_weight`` (``ones(3)``: IN, LN and BN start mixed 1/3 each): ``2C + 6`` parameters.

    Args:
        num_features: the channels ``C``.
        eps: added to the variance.
        momentum: the running statistics' decay (0.9 keeps 90 % of the old value).

    Example:
        >>> sn = SwitchNorm2d(3)
        >>> sum(p.numel() for p in sn.parameters()), sn(torch.randn(4, 3, 5, 5)).shape
        (12, torch.Size([4, 3, 5, 5]))
    """

    running_mean: Tensor
    running_var: Tensor

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.9) -> None:
        check(_is_int(num_features) and num_features >= 1, "num_features", num_features, "an int >= 1")
        check(isinstance(eps, (int, float)) and eps > 0, "eps", eps, "a number > 0")
        check(isinstance(momentum, (int, float)) and 0 <= momentum <= 1, "momentum", momentum, "a number in [0, 1]")
        super().__init__()
        self.num_features = num_features
        self.eps = float(eps)
        self.momentum = float(momentum)
        self.weight = nn.Parameter(torch.ones(1, num_features, 1, 1))
        self.bias = nn.Parameter(torch.zeros(1, num_features, 1, 1))
        self.mean_weight = nn.Parameter(torch.ones(3))
        self.var_weight = nn.Parameter(torch.ones(3))
        self.register_buffer("running_mean", torch.zeros(1, num_features, 1))
        self.register_buffer("running_var", torch.zeros(1, num_features, 1))

    def forward(self, x: Tensor) -> Tensor:
        """Normalise ``x`` ``[N, C, H, W]`` (H·W >= 2: the instance variance is unbiased)."""
        check(x.dim() == 4 and x.shape[1] == self.num_features and x.shape[2] * x.shape[3] >= 2, "x",
              tuple(x.shape), f"a [N, {self.num_features}, H, W] tensor with H·W >= 2")
        n, c, h, w = x.shape
        flat = x.reshape(n, c, h * w)
        mean_in = flat.mean(-1, keepdim=True)
        var_in = flat.var(-1, keepdim=True)  # unbiased, as the official SN code
        second = var_in + mean_in ** 2
        mean_ln = mean_in.mean(1, keepdim=True)
        var_ln = second.mean(1, keepdim=True) - mean_ln ** 2
        if self.training:
            mean_bn = mean_in.mean(0, keepdim=True)
            var_bn = second.mean(0, keepdim=True) - mean_bn ** 2
            with torch.no_grad():
                self.running_mean.mul_(self.momentum).add_((1 - self.momentum) * mean_bn)
                self.running_var.mul_(self.momentum).add_((1 - self.momentum) * var_bn)
        else:
            mean_bn, var_bn = self.running_mean, self.running_var
        mw = torch.softmax(self.mean_weight, 0)
        vw = torch.softmax(self.var_weight, 0)
        mean = mw[0] * mean_in + mw[1] * mean_ln + mw[2] * mean_bn
        var = vw[0] * var_in + vw[1] * var_ln + vw[2] * var_bn
        out = ((flat - mean) / (var + self.eps).sqrt()).view(n, c, h, w)
        return out * self.weight + self.bias


class GatingLayer(nn.Module):
    """pFedGate's private gating layer φ (§5.2.1, Fig. 2): from a raw input batch to the block importances ``G`` and
    the gated weights ``M``, one value per block of the global model.

    ``x → SwitchNorm2d(C)`` (pre-norm) ``→ flatten [B, d_X] →`` path A ``Linear(d_X, L) → BatchNorm1d(L)``
    (post-norm) ``→ sigmoid → mean over the batch``. ``G = clip(A, min=s_min)`` ranks the blocks (the code,
    ``gated_learner.py:108``); ``M`` is path B's output when ``separate_paths`` (the paper's two FC layers, the code's
    ``seperate_trans=1``; path B starts as a copy of path A, the code's ``deepcopy``) or path A's unclipped output
    when not (one shared path, the code's default ``seperate_trans=0``). The batch mean makes one mask per mini-batch.

    The whole forward runs in float32, with autocast disabled, whatever the surrounding precision. In training mode
    a batch needs at least 2 samples (BatchNorm1d; the code skips batches of size 1).

    Parameter count (trainable, ``P`` paths): ``2C + 6 + P · [(d_X + 1) · L + 2L]``; for LeNet-CIFAR (L = 50,
    d_X = 3072) 153,762 with one path and 307,512 with two (the paper's ``2·d_X·L`` = 307,200 counts FC weights
    only). Initialisation is PyTorch's default throughout, as in the code.

    Config example (inside a callback's arguments): ``gate: {separate_paths: false}``

    Args:
        num_blocks: ``L``, the number of blocks of the global model (``BlockTable.num_blocks``).
        in_channels: input channels ``C``.
        input_size: input side (or ``(H, W)``), at full resolution (``d_X = C·H·W``).
        separate_paths: two FC+BN paths (paper, default) or one shared path (the code's default).

    Example:
        >>> gate = GatingLayer(50, in_channels=3, input_size=32, separate_paths=False)
        >>> sum(p.numel() for p in gate.parameters())
        153762
        >>> g, m = gate(torch.randn(8, 3, 32, 32), s_min=0.2)
        >>> g.shape, bool((g >= 0.2).all()), bool(torch.equal(g, m.clamp(min=0.2)))
        (torch.Size([50]), True, True)
    """

    def __init__(self, num_blocks: int, in_channels: int = 3, input_size: int | Sequence[int] = 32, *,
                 separate_paths: bool = True) -> None:
        check(_is_int(num_blocks) and num_blocks >= 1, "num_blocks", num_blocks, "an int >= 1")
        check(_is_int(in_channels) and in_channels >= 1, "in_channels", in_channels, "an int >= 1")
        hw = _side_pair(input_size)
        check(hw is not None, "input_size", input_size, "an int >= 2 or a pair (H, W) of ints with H·W >= 2")
        assert hw is not None
        check(isinstance(separate_paths, bool), "separate_paths", separate_paths, "true or false")
        super().__init__()
        self.num_blocks = num_blocks
        self.in_shape = (in_channels, hw[0], hw[1])
        self.separate_paths = separate_paths
        d_x = math.prod(self.in_shape)
        self.norm_input = SwitchNorm2d(in_channels)
        self.gating = nn.Sequential(nn.Flatten(), nn.Linear(d_x, num_blocks), nn.BatchNorm1d(num_blocks))
        self.w_transform = copy.deepcopy(self.gating) if separate_paths else None

    def forward(self, x: Tensor, s_min: float | None = None) -> tuple[Tensor, Tensor]:
        """Return ``(G, M)``, each ``[L]`` float32: the importances clipped at ``s_min`` (unclipped when ``None``)
        and the gated weights."""
        check(x.dim() == 4 and tuple(x.shape[1:]) == self.in_shape, "x", tuple(x.shape),
              f"a [B, {', '.join(map(str, self.in_shape))}] batch (the gate's input shape)")
        check(not self.training or x.shape[0] >= 2, "x.shape[0]", x.shape[0],
              "a batch of >= 2 samples in training mode (BatchNorm1d post-norm; skip batches of size 1)")
        check(s_min is None or (isinstance(s_min, (int, float)) and 0 <= s_min <= 1), "s_min", s_min,
              "None or a number in [0, 1]")
        with torch.autocast(device_type=x.device.type, enabled=False):
            z = self.norm_input(x.float())
            scores = torch.sigmoid(self.gating(z)).mean(0)
            weights = torch.sigmoid(self.w_transform(z)).mean(0) if self.w_transform is not None else scores
            importance = scores if s_min is None else torch.clamp(scores, min=float(s_min))
        return importance, weights


def adapted_forward(model: nn.Module, params: Mapping[str, Tensor], x: Tensor, *, relu_logits: bool = False) -> Tensor:
    """The personalised model's forward with ``θ'`` substituted for the model's parameters through
    ``torch.func.functional_call``: the model's own tensors are neither replaced nor written, so one backward reaches
    both θ and the gate (Alg. 1 lines 6-7). Names missing from ``params`` use the model's own tensors.

    Args:
        model: the global model.
        params: ``θ'`` by name (:func:`pl_fedsparse.functional.gate.personalized_params`).
        x: the input batch.
        relu_logits: apply ReLU to the output logits, the quirk of the code's ``adapted_forward``
            (``models/adapted_op.py:57,103,161``); default off (the paper).

    Example:
        >>> lin = nn.Linear(2, 1, bias=False)
        >>> adapted_forward(lin, {"weight": torch.tensor([[1.0, -3.0]])}, torch.ones(1, 2), relu_logits=True)
        tensor([[0.]])
    """
    out = torch.func.functional_call(model, dict(params), (x,))
    return F.relu(out) if relu_logits else out
