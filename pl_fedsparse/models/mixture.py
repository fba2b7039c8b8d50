"""A mixture of ``M`` copies of a network: the model of FedEM (Marfoq et al., NeurIPS 2021).

Why a backbone and not M modules kept by a callback: the loop, its aggregation, its byte ledger and its checkpoints
all see *one* state dict per model. Wrapping the M components in one ``nn.Module`` makes them one state dict
(``backbone.components.<m>.…``), so FedAvg averages every component separately (FedEM's aggregation, Alg. 1), the
messages carry the M models up and down (M × d values: FedEM's communication cost, pFedGate Table 5), and resuming,
mixed precision and FLOP counting need nothing new. Only the mixture weights ``π`` are per client: they are the
buffer ``mixture_weights``, which :class:`~pl_fedsparse.callbacks.FedEM` fills with the client's own weights and
keeps out of every message.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from pl_fedsparse.errors import check
from pl_fedsparse.functional.mixture import mixture_log_prob

__all__ = ["Mixture"]


class Mixture(nn.Module):
    """``M`` components ``h_{θ_1} … h_{θ_M}`` of one architecture and mixture weights ``π`` (a buffer, uniform at
    first): the forward returns ``log Σ_m π_m softmax(h_{θ_m}(x))`` (FedEM's prediction), which serves as logits
    (argmax = the mixture's prediction; cross-entropy = its negative log-likelihood).

    Component 0 is ``backbone`` as given; components 1…M−1 are copies whose layers are re-drawn with their own
    ``reset_parameters`` (the FedEM code builds learner ``m`` with seed ``seed + m``: distinct initialisations, the
    same for every client). A network with a custom initialisation (e.g. ``VGG11GN``) keeps it only in component 0.

    Args:
        backbone: the component network (any ``[B, …] → [B, C]`` classifier).
        num_components: ``M`` (FedEM's default and pFedGate's comparison: 3).

    Example:
        .. code-block:: yaml

            model:
              backbone:
                class_path: pl_fedsparse.models.Mixture
                init_args:
                  backbone: {class_path: pl_fedsparse.models.LeNetCIFAR, init_args: {num_classes: 10}}
                  num_components: 3

        >>> from pl_fedsparse.models import MLP
        >>> net = Mixture(MLP(num_classes=4, in_features=8, hidden=[]), num_components=3)
        >>> bool(torch.allclose(net(torch.zeros(2, 8)).exp().sum(1), torch.ones(2)))  # a distribution per sample
        True
        >>> sum(p.numel() for p in net.parameters()), net.mixture_weights
        (108, tensor([0.3333, 0.3333, 0.3333]))
    """

    mixture_weights: Tensor  #: π, ``[M]`` (a buffer: loaded with a client's state, never trained)

    def __init__(self, backbone: nn.Module, num_components: int = 3) -> None:
        check(isinstance(backbone, nn.Module), "model.backbone.init_args.backbone", backbone, "a torch.nn.Module")
        check(isinstance(num_components, int) and not isinstance(num_components, bool) and num_components >= 1,
              "model.backbone.init_args.num_components", num_components, "an int >= 1")
        super().__init__()
        components = [backbone]
        for _ in range(num_components - 1):
            other = copy.deepcopy(backbone)
            for layer in other.modules():
                reset = getattr(layer, "reset_parameters", None)
                if callable(reset):
                    reset()
            components.append(other)
        self.components = nn.ModuleList(components)
        self.register_buffer("mixture_weights", torch.full((num_components,), 1.0 / num_components))

    @property
    def num_components(self) -> int:
        """``M``."""
        return len(self.components)

    def component_logits(self, x: Tensor) -> Tensor:
        """Every component's logits, ``[B, M, C]``."""
        return torch.stack([c(x) for c in self.components], dim=1)

    def forward(self, x: Tensor) -> Tensor:
        """``log Σ_m π_m softmax(h_{θ_m}(x))``, ``[B, C]`` (float32)."""
        return mixture_log_prob(self.component_logits(x), self.mixture_weights)
