"""Novel clients: :class:`NovelClients` holds a share of the federation out of training and reports it separately
(pFedGate, Chen et al. ICML 2023, App. I.1 and Table 8; pFL-Bench's ``unseen_clients_rate``).

A seeded ``fraction`` of the clients (0.2 in the paper) never trains. After the last round each of them adapts
locally, starting from the final global model (a ``"finetune"`` fit of ``epochs`` epochs; the download is counted):
with :class:`~pl_fedsparse.callbacks.PFedGate` only its private gate trains and the global model stays frozen (the
paper's "pFedGate only needs to train the personalized lightweight gating layers"), with any other method the whole
model is fine-tuned ("the novel clients only fine-tune the global model"). The evaluation then reports, besides the
usual metrics over all clients:

=======================  =================================================================================
metric                   meaning
=======================  =================================================================================
``seen/acc_weighted``    sample-weighted personal accuracy of the clients that took part in training (Acc̄)
``seen/acc_mean``        their unweighted mean
``seen/acc_bottom10``    their bottom decile: the ``⌊N/10⌋``-th worst accuracy (Table 1's Acc̆ over the clients
                         that trained; :func:`~pl_fedsparse.metrics.bottom_decile`)
``novel/acc_weighted``   the same over the novel clients (Acc̃; after the last round: adapted)
``novel/acc_mean``       their unweighted mean
``novel/gap``            Δ = Acc̄ − Acc̃ (weighted), Table 8's generalisation gap
=======================  =================================================================================

Before the last round the novel clients are evaluated unadapted (the global model, through their initial gate).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from torch import Tensor
from typing_extensions import override

from pl_fedsparse.callbacks.base import FederatedCallback
from pl_fedsparse.client import ClientUpdate, Message
from pl_fedsparse.context import FitSpec, FitStage
from pl_fedsparse.errors import ConfigError, check
from pl_fedsparse.metrics import bottom_decile
from pl_fedsparse.streams import register_stream

if TYPE_CHECKING:
    from pl_fedsparse.view import FederationView

__all__ = ["NovelClients"]

register_stream("novel_clients")  # which clients are held out (key 0)


class NovelClients(FederatedCallback):
    """Hold out ``fraction`` of the clients from training, adapt them after the last round, report them apart.

    Owns the ``select_clients`` policy: every round samples among the other clients only, ``trainer.join_ratio``
    (or ``clients_per_round``) of *them*, seeded by the round as the loop's default.

    Args:
        fraction: share of novel clients, rounded to a whole number in ``[1, K − 1]`` (paper: 0.2).
        epochs: local epochs of the final adaptation.

    Example:
        .. code-block:: yaml

            trainer:
              callbacks:
                - {class_path: pl_fedsparse.callbacks.PFedGate, init_args: {density: 0.5}}
                - {class_path: pl_fedsparse.callbacks.NovelClients, init_args: {fraction: 0.2}}
    """

    def __init__(self, *, fraction: float = 0.2, epochs: int = 1) -> None:
        check(isinstance(fraction, (int, float)) and not isinstance(fraction, bool) and 0 < fraction < 1,
              "NovelClients.fraction", fraction, "a number in (0, 1) (paper: 0.2)")
        check(isinstance(epochs, int) and not isinstance(epochs, bool) and epochs >= 1, "NovelClients.epochs",
              epochs, "an int >= 1")
        self.fraction, self.epochs = float(fraction), epochs
        self.novel: list[int] = []
        self._acc: dict[int, tuple[float, float]] = {}

    @override
    def setup_federation(self, loop: FederationView) -> None:
        n = loop.num_clients
        if n < 2:
            raise ConfigError(f"data.num_clients={n} is invalid for NovelClients: expected at least 2 clients")
        count = min(max(1, round(self.fraction * n)), n - 1)
        order = loop.streams.numpy("novel_clients", 0).permutation(n)
        self.novel = sorted(int(k) for k in order[:count])
        self.add_client_state(loop, "weights", lambda k: {})  # a novel client's adapted model ({}: not yet)

    def is_novel(self, client_idx: int) -> bool:
        """Whether ``client_idx`` is held out of training."""
        return client_idx in self.novel

    @override
    def select_clients(self, loop: FederationView, round_idx: int, client_ids: Sequence[int]) -> list[int]:
        dropped = loop.topology.dropped(round_idx, len(client_ids), loop.seed)
        ids = [k for k in client_ids if k not in self.novel and k not in dropped]
        m = loop.clients_per_round or max(1, int(loop.join_ratio * (loop.num_clients - len(self.novel)) + 1e-9))
        if m >= len(ids):
            return ids
        rng = loop.streams.numpy("sample", round_idx)
        return sorted(ids[int(i)] for i in rng.choice(len(ids), size=m, replace=False))

    @override
    def fit_requests(self, loop: FederationView, stage: FitStage, updates: Sequence[ClientUpdate]) -> list[FitSpec]:
        if stage != "after_aggregate" or loop.round_idx != loop.num_rounds - 1 or loop.global_state is None:
            return []
        start = loop.global_state
        return [FitSpec(k, "finetune", start, epochs=self.epochs, download=Message(start)) for k in self.novel]

    @override
    def on_requested_fits_end(self, loop: FederationView, stage: FitStage, updates: Sequence[ClientUpdate]) -> None:
        for u in updates:
            self.set_client_state(loop, u.client_idx, "weights", u.state)

    @override
    def evaluation_start_is_shared(self, loop: FederationView, kind: str) -> bool:
        return kind != "personal"  # a novel client's fine-tuned weights replace its personal model

    @override
    def on_client_evaluate_start(self, loop: FederationView, module: pl.LightningModule, client_idx: int,
                                 kind: str) -> None:
        if kind == "personal" and self.is_novel(client_idx):
            tuned: dict[str, Tensor] = self.get_client_state(loop, client_idx, "weights")
            if tuned:
                loop.load_state(tuned)

    @override
    def on_client_evaluate_end(self, loop: FederationView, module: pl.LightningModule, client_idx: int, kind: str,
                               metrics: dict[str, float]) -> None:
        if kind == "personal":
            self._acc[client_idx] = (float(metrics["acc"]), float(metrics["n"]))

    @override
    def on_evaluation_end(self, loop: FederationView, metrics: dict[str, Any]) -> None:
        acc, self._acc = self._acc, {}
        for group, members in (("seen", [k for k in acc if not self.is_novel(k)]), ("novel", self.novel)):
            rows = [acc[k] for k in members if k in acc and acc[k][1] > 0]
            total = sum(n for _, n in rows)
            metrics[f"{group}/acc_weighted"] = sum(a * n for a, n in rows) / total if total else None
            metrics[f"{group}/acc_mean"] = sum(a for a, _ in rows) / len(rows) if rows else None
        seen_acc = [a for k, (a, n) in acc.items() if not self.is_novel(k) and n > 0]
        metrics["seen/acc_bottom10"] = bottom_decile(seen_acc) if seen_acc else None
        seen, novel = metrics["seen/acc_weighted"], metrics["novel/acc_weighted"]
        metrics["novel/gap"] = seen - novel if seen is not None and novel is not None else None

    @override
    def report_rows(self, loop: FederationView) -> list[tuple[str, str]]:
        return [("seen clients acc (weighted)", "seen/acc_weighted"),
                ("seen clients bottom decile", "seen/acc_bottom10"),
                ("novel clients acc (weighted)", "novel/acc_weighted"), ("novel gap Δ", "novel/gap")]
