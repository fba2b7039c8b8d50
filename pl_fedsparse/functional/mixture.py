"""FedEM's maths (Marfoq, Neglia, Bellet, Kameni, Vidal, "Federated Multi-Task Learning under a Mixture of
Distributions", NeurIPS 2021): every client's data distribution is a mixture of ``M`` shared components,
``p_t(y | x) = Σ_m π_{t,m} · p_m(y | x)`` with ``p_m(y | x) = softmax(h_{θ_m}(x))_y``, and each client fits its
mixture weights ``π_t`` by EM while the components are trained and averaged by the federation (§3, Alg. 1).

Tensors in, tensors out: component logits are ``[B, M, C]`` (batch, component, class), responsibilities ``[B, M]``,
mixture weights ``[M]``. The :class:`~pl_fedsparse.callbacks.FedEM` callback holds the state and calls these.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["component_log_likelihood", "e_step", "m_step_weights", "mixture_log_prob", "weighted_nll"]


def component_log_likelihood(logits: Tensor, y: Tensor) -> Tensor:
    """``log p_m(y_i | x_i)`` of every sample under every component: ``[B, M]`` from ``[B, M, C]`` logits (the
    negative cross-entropy, computed in float32).

    Example:
        >>> logits = torch.tensor([[[0.0, 0.0], [2.0, 0.0]]])  # one sample, two components, two classes
        >>> component_log_likelihood(logits, torch.tensor([0])).exp()
        tensor([[0.5000, 0.8808]])
    """
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, y.view(-1, 1, 1).expand(-1, logits.shape[1], 1)
                                                            ).squeeze(-1)


def e_step(log_lik: Tensor, weights: Tensor) -> Tensor:
    """The E-step (§3, Alg. 1): responsibilities ``q_i(z = m) = π_m p_m(y_i|x_i) / Σ_m' π_m' p_m'(y_i|x_i)``,
    i.e. a softmax over components of ``log π_m + log p_m(y_i | x_i)`` (the FedEM code's
    ``softmax(log π − losses)``). A component with ``π_m = 0`` gets ``q = 0``.

    Args:
        log_lik: ``[B, M]`` log-likelihoods (:func:`component_log_likelihood`).
        weights: ``[M]`` mixture weights π (on the simplex).

    Example:
        >>> q = e_step(torch.log(torch.tensor([[0.5, 0.25]])), torch.tensor([0.5, 0.5]))
        >>> q  # 0.5·0.5 : 0.5·0.25 = 2 : 1
        tensor([[0.6667, 0.3333]])
    """
    return torch.softmax(torch.log(weights.float()) + log_lik.float(), dim=-1)


def m_step_weights(q: Tensor) -> Tensor:
    """The M-step for the mixture weights (§3, Alg. 1): ``π_m = (1/n) Σ_i q_i(z = m)`` over the client's ``n``
    training samples.

    Example:
        >>> m_step_weights(torch.tensor([[0.6, 0.4], [0.2, 0.8]]))
        tensor([0.4000, 0.6000])
    """
    return q.float().mean(0)


def mixture_log_prob(logits: Tensor, weights: Tensor) -> Tensor:
    """Log of the client's prediction ``Σ_m π_m softmax(h_{θ_m}(x))`` (the FedEM code's ``evaluate_iterator``),
    ``[B, C]`` from ``[B, M, C]``, by a stable log-sum-exp. Its softmax is the mixture itself, so it can stand for
    logits: argmax gives the mixture's prediction, cross-entropy its negative log-likelihood.

    Example:
        >>> logits = torch.tensor([[[0.0, 0.0], [2.0, 0.0]]])
        >>> mixture_log_prob(logits, torch.tensor([0.5, 0.5])).exp()  # 0.5·(0.5, 0.5) + 0.5·(0.881, 0.119)
        tensor([[0.6904, 0.3096]])
    """
    log_w = torch.log(weights.float()).view(1, -1, 1)
    return torch.logsumexp(log_w + torch.log_softmax(logits.float(), dim=-1), dim=1)


def weighted_nll(logits: Tensor, y: Tensor, q: Tensor, label_smoothing: float = 0.0) -> Tensor:
    """The components' M-step objective on one batch: ``Σ_m (1/B) Σ_i q_i(z = m) · CE(h_{θ_m}(x_i), y_i)`` (§3,
    Alg. 1: each component minimises its responsibility-weighted loss; the FedEM code's
    ``loss_vec @ weights[indices] / batch_size`` summed over the learners, which share no parameter). ``q`` is
    treated as a constant.

    Example:
        >>> logits = torch.tensor([[[0.0, 0.0], [2.0, 0.0]]])
        >>> q = torch.tensor([[0.25, 0.75]])
        >>> round(float(weighted_nll(logits, torch.tensor([0]), q)), 4)  # 0.25·ln 2 + 0.75·ln(1 + e^-2)
        0.2685
    """
    b, m, c = logits.shape
    per = F.cross_entropy(logits.reshape(b * m, c), y.repeat_interleave(m), reduction="none",
                          label_smoothing=label_smoothing).view(b, m)
    return (q.detach().to(per.dtype) * per).sum() / b
