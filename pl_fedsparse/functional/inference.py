"""Adaptive inference between a personal and a global model (DM-PFL+, Zhang et al. KDD 2023, Alg. 4).

Pure tensor maths on logits; :class:`~pl_fedsparse.callbacks.AdaptiveInference` holds the per-client base entropies
and applies it during evaluation.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["adaptive_choice", "entropy", "output_cosine"]


def entropy(logits: Tensor) -> Tensor:
    """Shannon entropy (nats) of the softmax of each row of ``logits`` ``[n, C]``.

    Example:
        >>> entropy(torch.zeros(1, 4)).item() == torch.log(torch.tensor(4.)).item()
        True
        >>> round(entropy(torch.tensor([[100., 0.]])).item(), 6)
        0.0
    """
    logp = torch.log_softmax(logits.float(), dim=1)
    return -(logp.exp() * logp).sum(dim=1)


def output_cosine(logits_a: Tensor, logits_b: Tensor, on: str = "softmax") -> Tensor:
    """Row-wise cosine similarity of two models' outputs, on their softmax probabilities (default) or raw logits.

    Example:
        >>> output_cosine(torch.tensor([[1., 0.]]), torch.tensor([[1., 0.]])).item()
        1.0
    """
    if on == "softmax":
        logits_a, logits_b = torch.softmax(logits_a.float(), 1), torch.softmax(logits_b.float(), 1)
    return torch.nn.functional.cosine_similarity(logits_a.float(), logits_b.float(), dim=1)


def adaptive_choice(logits_c: Tensor, logits_g: Tensor, base_c: float, base_g: float,
                    cosine_on: str = "softmax") -> Tensor:
    """Per sample, whether Alg. 4 predicts with the personal model θ_c (``True``) or the global θ_g (``False``).

    Lines 1-3: ``E_c = H(θ_c(x))``, ``E_g = H(θ_g(x))``, ``Sim = cos(θ_c(x), θ_g(x))``; lines 4-7: choose θ_c iff
    ``E_c − (1 − Sim)·BE(θ_c) < E_g − (1 − Sim)·BE(θ_g)``, where ``BE`` are the models' base (unshifted) entropies.

    Args:
        logits_c: personal model logits ``[n, C]``.
        logits_g: global model logits ``[n, C]``.
        base_c: base entropy of the personal model.
        base_g: base entropy of the global model.
        cosine_on: ``"softmax"`` or ``"logits"`` (what the cosine similarity compares).

    Example:
        >>> c = torch.tensor([[4., 0.], [0.6, 0.4]])   # confident / unsure personal outputs
        >>> g = torch.tensor([[0.5, 0.5], [0., 4.]])   # unsure / confident global outputs
        >>> adaptive_choice(c, g, base_c=0.1, base_g=0.3).tolist()
        [True, False]
    """
    e_c, e_g = entropy(logits_c), entropy(logits_g)
    sim = output_cosine(logits_c, logits_g, cosine_on)
    return e_c - (1 - sim) * base_c < e_g - (1 - sim) * base_g
