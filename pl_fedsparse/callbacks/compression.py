"""FedPSE's two baselines as callbacks on FedPSE's parts ("FedPSE: Personalized Sparsification with Element-wise
Aggregation for Federated Learning", anonymous ICLR submission, §5.2 and Table 1;
what was taken from where: ``papers/fedpse/baselines.md``).

* **FedSTC** (Sattler et al. 2019) = :class:`~pl_fedsparse.callbacks.TopKUpload` with ``quantize: ternary`` +
  :class:`~pl_fedsparse.callbacks.ElementwiseAggregation` with ``mode: mean`` + :class:`SparseDownstream` (ternary,
  with the server's error feedback). Every client holds the same model, moved by the ternary broadcasts
  (``configs/fmnist_fedstc.yaml``).
* **FedSCR** (Wu et al. 2021) = :class:`StructuredUpload` + ``ElementwiseAggregation(mode: mean)``; the server sends
  its dense model back, as FedSCR reduces only the upstream (``configs/fmnist_fedscr.yaml``).
"""

from __future__ import annotations

from typing import Literal

from torch import Tensor
from typing_extensions import override

from pl_fedsparse.callbacks.fedpse import PersonalizedDownstream, ResidualUpload
from pl_fedsparse.errors import check
from pl_fedsparse.functional.compression import structured_mask

__all__ = ["StructuredUpload", "SparseDownstream"]


class SparseDownstream(PersonalizedDownstream):
    """The same top-k server update ``ΔŴ_s`` for every client (no personalisation); FedSTC's downstream with
    ``quantize: ternary`` and ``error_feedback: true`` (Sattler et al. Alg. 2). A client that missed rounds receives
    their sum when next sampled (STC's caching).

    Args:
        sparsity: the share of the server update's entries not sent (FedPSE's comparison: 0.9 for every method).
        quantize: ``"ternary"`` (STC) or ``"none"``.
        error_feedback: keep the server's compression error for the next round (STC: true).
    """

    def __init__(self, *, sparsity: float = 0.9, quantize: Literal["none", "ternary"] = "ternary",
                 error_feedback: bool = True) -> None:
        super().__init__(sparsity=sparsity, personalized=False, quantize=quantize, error_feedback=error_feedback)


class StructuredUpload(ResidualUpload):
    """FedSCR's upload: the round's update plus the residual, with the filters and channels of small summed magnitude
    dropped and kept as the residual (:func:`~pl_fedsparse.functional.compression.structured_mask`).

    Tensors with fewer than two dimensions (biases) are sent whole: FedSCR prunes filters and channels only.

    Args:
        sparsity: per tensor, the smallest threshold that keeps at most ``1 − p`` of its entries (FedPSE's comparison
            fixes p = 0.9 for every method). Give ``sparsity: null`` and a ``threshold`` for FedSCR's fixed one.
        threshold: FedSCR's absolute threshold on the summed magnitudes of a filter or channel.
    """

    def __init__(self, *, sparsity: float | None = 0.9, threshold: float | None = None) -> None:
        check((sparsity is None) != (threshold is None), "StructuredUpload.sparsity/threshold", (sparsity, threshold),
              "exactly one of them (sparsity: null to use a threshold)")
        check(sparsity is None or 0 <= sparsity < 1, "StructuredUpload.sparsity", sparsity,
              "a number in [0, 1) (0.9 keeps at most 10 %) or null")
        check(threshold is None or threshold >= 0, "StructuredUpload.threshold", threshold, "a number >= 0 or null")
        self.sparsity, self.threshold = sparsity, threshold
        self._start = {}

    @override
    def residual_names(self, state: dict[str, Tensor]) -> list[str]:
        return [n for n, t in state.items() if t.is_floating_point() and t.dim() >= 2]

    @override
    def compress(self, raw: dict[str, Tensor], residual: dict[str, Tensor]
                 ) -> tuple[dict[str, Tensor], dict[str, Tensor], dict[str, Tensor], frozenset[str]]:
        sent, masks, new_res = {}, {}, {}
        for n, delta in raw.items():
            if n not in residual:  # a bias: sent whole
                sent[n] = delta
                continue
            acc = delta + residual[n]
            keep = structured_mask(acc, threshold=self.threshold, sparsity=self.sparsity)
            sent[n], masks[n] = acc * keep, keep
            new_res[n] = acc * ~keep
        return sent, masks, new_res, frozenset()
