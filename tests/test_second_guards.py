"""Second, independent guards for mechanisms that another single test used to guard alone.

* FedSpa (Huang et al., "Achieving Personalized Federated Learning with Sparse Local Models"): two rounds of
  :class:`~pl_fedsparse.callbacks.GradientRegrow` + :class:`~pl_fedsparse.callbacks.FedSpaAggregation` equal a plain
  re-implementation of Alg. 1 written here — masked local SGD (Eq. 3), the Eq. 4 server update, and Alg. 2's
  prune-and-regrow (drop the smallest |w|, regrow by the largest |dense gradient|) with its own selection code, not
  the library's kernel; and ``GradientRegrow.next_masks`` on hand-made weights and gradients.
* FedPSE (Wu et al., "FedPSE: Personalized Sparsification with Element-wise Aggregation for Federated Learning"):
  :class:`~pl_fedsparse.callbacks.ElementwiseAggregation` in each mode — EWA (§4.3, Alg. 2) and the "without EWA"
  ablation (FedAvg's plain mean, §5.5, Fig. 4) — against a hand computation, at the callback.
* D-PSGD-FT: :class:`~pl_fedsparse.callbacks.FineTune` with ``start: consensus`` asks every client to fine-tune the
  plain uniform average of all clients' models (hand-made, masked and dense), and a whole run's fine-tuned models
  equal one epoch of plain SGD from the by-hand consensus.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import plain_dense_gradient, plain_masked_epoch, tiny_datamodule, tiny_loop, tiny_module

from pl_fedsparse import ClientUpdate, Message, Ring
from pl_fedsparse.callbacks import (
    ElementwiseAggregation,
    FedSpaAggregation,
    FineTune,
    Gossip,
    GradientRegrow,
    TopKUpload,
)
from pl_fedsparse.callbacks.fedpse import DELTA
from pl_fedsparse.functional import pack_masks

ROUNDS, CLIENTS, ALPHA0, LR = 2, 4, 0.5, 0.1


# ---- plain re-implementations (no library kernel) ------------------------------------------------------------------
def _prune_regrow(mask: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor, rate: float) -> torch.Tensor:
    """FedSpa Alg. 2 on one tensor, by sorting: drop the ``ceil(rate · nnz)`` active entries of smallest |w|, then
    grow as many of the entries inactive after the drop with the largest |g| (ties: the lower flat index first)."""
    flat = mask.flatten().clone()
    k = math.ceil(rate * int(flat.sum()))
    active = flat.nonzero().flatten()
    dropped = active[torch.sort(weight.flatten()[active].abs(), stable=True).indices[:k]]
    flat[dropped] = False
    inactive = (~flat).nonzero().flatten()
    grown = inactive[torch.sort(-grad.flatten()[inactive].abs(), stable=True).indices[:k]]
    flat[grown] = True
    return flat.view(mask.shape)


# ---- FedSpa ---------------------------------------------------------------------------------------------------------
def test_two_fedspa_rounds_equal_a_plain_implementation_of_alg_1(tmp_path: Path) -> None:
    """Per round ``t`` the sampled clients ``S_t`` start from ``m_k ⊙ W`` (dense tensors: ``W``), train one epoch
    of masked SGD (Eq. 3), prune ``α_t = α₀/2 · (1 + cos(π t / T))`` of each mask's active entries by smallest |w|
    of the trained weights and regrow as many by largest |gradient| of one local batch (Alg. 2); the server applies
    ``W ← W − (1/|S_t|) Σ_k (m_k ⊙ W − w_k)`` (Eq. 4); clients not sampled keep their masks (Alg. 1 line 7)."""
    cb = GradientRegrow(density=0.5, alpha0=ALPHA0)
    loop = tiny_loop(tmp_path, num_rounds=ROUNDS, clients_per_round=2, callbacks=[cb, FedSpaAggregation()])
    loop.fit(tiny_module(), tiny_datamodule(num_clients=CLIENTS))
    dm = tiny_datamodule(num_clients=CLIENTS)
    dm.setup("fit")

    W = {k: v.clone() for k, v in tiny_module().state_dict().items()}  # Alg. 1 line 2: one dense global model
    masks = {k: cb.draw_mask(loop, k) for k in range(CLIENTS)}  # line 3
    first = masks[0]
    assert all(torch.equal(masks[k][n], first[n]) for k in masks for n in first)  # FedSpa: the same initial mask
    sampled_ever: set[int] = set()
    for t in range(ROUNDS):
        S = loop.select_clients(t)
        assert 0 < len(S) < CLIENTS  # partial participation: the 1/|S_t| of Eq. 4 is not 1/K
        sampled_ever.update(S)
        rate = ALPHA0 / 2 * (1 + math.cos(math.pi * t / ROUNDS))
        step = {n: torch.zeros_like(v) for n, v in W.items()}
        new_masks = {}
        for k in S:
            start = {n: (v * masks[k][n] if n in masks[k] else v) for n, v in W.items()}  # W_{k,t,0} = m_k ⊙ W_t
            seed = loop.streams.fit_seed("train", t, k)
            trained = plain_masked_epoch(start, {n: m.float() for n, m in masks[k].items()},
                                         dm.train_loader(k, seed=seed), seed, LR)
            grad = plain_dense_gradient(trained, dm.train_loader(k, seed=loop.streams.seed("grow", t, k)))
            new_masks[k] = {n: _prune_regrow(m, trained[n], grad[n], rate) for n, m in masks[k].items()}
            for n in W:
                step[n] += (start[n] - trained[n]) / len(S)  # U_k = W_{k,t,0} − W_{k,t,N}
        W = {n: W[n] - step[n] for n in W}  # Eq. 4
        masks.update(new_masks)

    for n, v in W.items():
        torch.testing.assert_close(loop.global_state[n], v, rtol=1e-5, atol=1e-6)  # type: ignore[index]
    for k in range(CLIENTS):
        got = cb.masks(loop, k)
        assert all(torch.equal(got[n], masks[k][n]) for n in masks[k]), k
    assert sampled_ever and any(not torch.equal(masks[k][n], first[n]) for k in sampled_ever for n in first)
    for k in set(range(CLIENTS)) - sampled_ever:  # never sampled: the initial mask
        assert all(torch.equal(masks[k][n], first[n]) for n in first)


def test_gradient_regrow_next_mask_on_hand_made_weights_and_gradients(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """FedSpa Alg. 2 by hand at ``t = 0`` (``α_0 = α₀ = 0.5``): of the 6 active entries, ``ceil(0.5 · 6) = 3`` with
    the smallest |w| are dropped; of the 13 inactive after the drop, the 3 with the largest |gradient| are grown;
    the gradient is asked for once, one batch of the client's ``grow`` stream at (round, client)."""
    cb = GradientRegrow(density=0.5, alpha0=0.5)
    loop = tiny_loop(tmp_path, num_rounds=4, callbacks=[cb])
    loop.setup(tiny_module(), tiny_datamodule())
    mask = torch.tensor([1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], dtype=torch.bool).view(2, 8)
    w = torch.tensor([0.9, -0.05, 0.4, -0.7, 0.02, -0.3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]).view(2, 8)
    g = torch.tensor([5.0, 0.1, 9.0, 2.0, 0.3, 3.0, 0.2, -4.0, 0.5, -6.0, 1.0, 0.4, -0.6, 0.7, 3.5, 0.8]).view(2, 8)
    asked: list[tuple] = []

    def gradients(client_idx, names, *, keys, batches=1, stream="grow", update=None):  # type: ignore[no-untyped-def]
        asked.append((client_idx, list(names), tuple(keys), batches, stream))
        return {"w": g.clone()}

    monkeypatch.setattr(loop, "local_gradients", gradients)
    update = ClientUpdate(2, 0, 100, {"w": w}, masks={"w": mask})
    out = cb.next_masks(loop, loop.model, update)  # type: ignore[arg-type]
    # dropped: |w| = 0.02 (4), 0.05 (1), 0.3 (5); kept: 0, 2, 3
    # grown among {1, 4, 5, 6, ..., 15} by |g|: 6.0 (9), 4.0 (7), 3.5 (14); not 3.0 (5), not 9.0 (2, still active)
    expected = torch.zeros(16, dtype=torch.bool)
    expected[[0, 2, 3, 9, 7, 14]] = True
    assert out is not None and torch.equal(out["w"], expected.view(2, 8))
    assert asked == [(2, ["w"], (0, 2), 1, "grow")]  # one batch of the client's own grow stream at (round, client)


def test_gradient_regrow_regrows_a_just_dropped_entry_when_its_gradient_is_largest(tmp_path: Path,
                                                                                    monkeypatch: pytest.MonkeyPatch
                                                                                    ) -> None:
    """Alg. 2 regrows from the post-prune zero set: a dropped entry with the largest |gradient| comes straight back,
    while a larger |w| elsewhere does not save an entry with a small one."""
    cb = GradientRegrow(density=0.5, alpha0=0.5)
    loop = tiny_loop(tmp_path, num_rounds=4, callbacks=[cb])
    loop.setup(tiny_module(), tiny_datamodule())
    mask = torch.tensor([True, True, True, True, False, False, False, False])
    w = torch.tensor([-2.0, 0.1, 3.0, -0.2, 0.0, 0.0, 0.0, 0.0])
    g = torch.tensor([0.0, 7.0, 0.0, 1.0, 2.0, 0.5, 3.0, 0.0])
    monkeypatch.setattr(loop, "local_gradients", lambda *a, **kw: {"w": g.clone()})
    out = cb.next_masks(loop, loop.model, ClientUpdate(0, 0, 10, {"w": w}, masks={"w": mask}))  # type: ignore[arg-type]
    # drop 2 of 4: 0.1 (1) and 0.2 (3); grow 2 of {1, 3, 4, 5, 6, 7}: 7.0 (1, back again) and 3.0 (6)
    assert out is not None and out["w"].tolist() == [True, True, True, False, False, False, True, False]


# ---- FedPSE ---------------------------------------------------------------------------------------------------------
_GLOBAL = {"w": torch.tensor([1.0, 1.0, 1.0, 1.0]), "b": torch.tensor([0.5, -0.5])}


def _aggregate(tmp_path: Path, mode: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``ElementwiseAggregation(mode).aggregate`` on a set-up federation whose global model is ``_GLOBAL``, over the
    uploads below: ``(new global state, the published server update)``."""
    agg = ElementwiseAggregation(mode=mode)  # type: ignore[arg-type]
    loop = tiny_loop(tmp_path / mode, num_rounds=1, callbacks=[TopKUpload(), agg])
    loop.setup(tiny_module(), tiny_datamodule())
    loop.global_state = {n: t.clone() for n, t in _GLOBAL.items()}
    out = agg.aggregate(loop, [_upload(*u) for u in _UPLOADS])
    assert out is not None and loop.server_update is not None  # published for the downstream policy (DPS)
    return out, loop.server_update


def _upload(k: int, n_samples: int, samples_seen: float, w: list[float], b: list[float]) -> ClientUpdate:
    u = ClientUpdate(k, 0, n_samples, {}, message=Message({"w": torch.tensor(w), "b": torch.tensor(b)}),
                     metrics={"samples_seen": samples_seen})
    u.extras[DELTA] = True
    return u


# ΔW of three clients trained on 10, 30 and 60 samples this round (n_samples, their data sizes, differ on purpose:
# Alg. 1 line 7 counts the samples of the round's training)
_UPLOADS = [(0, 999, 10.0, [2.0, 0.0, 0.0, -1.0], [1.0, 0.0]),
            (1, 1, 30.0, [4.0, 6.0, 0.0, 0.0], [0.0, 0.0]),
            (2, 1, 60.0, [1.0, 0.0, 0.0, 3.0], [-2.0, 0.0])]
_EXPECTED = {
    # EWA: Σ nᵢΔŴᵢ / Σ nᵢ1[ΔŴᵢ ≠ 0] per element, 0 where nobody sent it
    #   w: (20 + 120 + 60)/100 = 2, 180/30 = 6, 0, (−10 + 180)/70 = 17/7;   b: (10 − 120)/70 = −11/7, 0
    "elementwise": {"w": [2.0, 6.0, 0.0, 17 / 7], "b": [-11 / 7, 0.0]},
    # without EWA (FedAvg's mean, zeros included): Σ nᵢΔŴᵢ / Σ nᵢ
    #   w: 200/100 = 2, 180/100 = 1.8, 0, 170/100 = 1.7;   b: −110/100 = −1.1, 0
    "mean": {"w": [2.0, 1.8, 0.0, 1.7], "b": [-1.1, 0.0]},
}


@pytest.mark.parametrize("mode", ["elementwise", "mean"])
def test_elementwise_aggregation_each_mode_equals_a_hand_computation(tmp_path: Path, mode: str) -> None:
    out, server_update = _aggregate(tmp_path, mode)
    for n, want in _EXPECTED[mode].items():
        torch.testing.assert_close(server_update[n], torch.tensor(want), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(out[n], _GLOBAL[n] + torch.tensor(want), rtol=1e-6, atol=1e-7)


def test_the_two_aggregation_modes_differ_exactly_where_a_client_sent_a_zero(tmp_path: Path) -> None:
    """On the same uploads the modes agree on elements every client sent (or nobody sent) and differ elsewhere —
    so a mode that is ignored cannot pass both hand computations above."""
    ewa, mean = _aggregate(tmp_path, "elementwise")[1], _aggregate(tmp_path, "mean")[1]
    same = {n: torch.isclose(ewa[n], mean[n]) for n in mean}
    assert same["w"].tolist() == [True, False, True, False] and same["b"].tolist() == [False, True]


# ---- D-PSGD-FT ------------------------------------------------------------------------------------------------------
def test_consensus_fine_tuning_requests_start_every_client_from_the_uniform_average(tmp_path: Path) -> None:
    """Hand-made client models (one tensor masked, others dense, client sizes unequal): every client's fine-tuning
    starts from ``(1/K) Σ_k w_k`` — not its own model, not a sample-weighted mean, not a per-coordinate mean over
    the masks — and is due only after aggregation in the last round (or every ``every``-th)."""
    gossip = Gossip()
    ft = FineTune(epochs=2, start="consensus", lr="reference")
    loop = tiny_loop(tmp_path, num_rounds=3, topology=Ring(), callbacks=[gossip, ft])
    loop.setup(tiny_module(), tiny_datamodule(num_clients=CLIENTS, quantity_skew=True))
    sizes = [loop.datamodule.num_samples(k) for k in range(CLIENTS)]
    assert len(set(sizes)) > 1  # unequal clients: a sample-weighted mean would differ from the uniform one
    name = next(k for k, v in loop.initial_state.items() if v.ndim == 2)
    shape = loop.initial_state[name].shape
    masks = [torch.zeros(shape, dtype=torch.bool) for _ in range(CLIENTS)]
    for m in masks:
        m[0, 0] = True  # held by all
    masks[0][0, 1] = masks[1][0, 1] = True  # held by two
    values = (1.0, 3.0, 8.0, 20.0)
    for j, v in enumerate(values):
        state = {n: torch.full_like(t, v * (i + 1)) for i, (n, t) in enumerate(loop.initial_state.items())}
        state[name] = torch.full(shape, v)[masks[j]]  # stored sparse, as Gossip keeps a masked model
        gossip.set_client_state(loop, j, "weights", state)
        gossip.set_client_state(loop, j, "mask", pack_masks({name: masks[j]}))

    loop.round_idx = 0
    assert ft.fit_requests(loop, "after_aggregate", []) == []  # not due before the last round
    loop.round_idx = 2
    assert ft.fit_requests(loop, "before_aggregate", []) == []
    specs = ft.fit_requests(loop, "after_aggregate", [])
    assert [s.client_idx for s in specs] == list(range(CLIENTS))
    mean = sum(values) / CLIENTS  # 8
    expected = {n: torch.full_like(t, mean * (i + 1)) for i, (n, t) in enumerate(loop.initial_state.items())}
    expected[name] = torch.zeros(shape)
    expected[name][0, 0] = mean  # (1 + 3 + 8 + 20) / 4
    expected[name][0, 1] = (1.0 + 3.0) / CLIENTS  # a uniform average of the models: 1, not (1 + 3) / 2
    for s in specs:
        assert (s.kind, s.epochs, s.lr_round, s.download) == ("finetune", 2, -1, None)  # no peer sends it
        assert s.start.keys() == expected.keys()
        for n, want in expected.items():
            torch.testing.assert_close(s.start[n], want, rtol=1e-6, atol=1e-7)


def test_consensus_fine_tuned_models_equal_one_epoch_of_sgd_from_the_by_hand_consensus(tmp_path: Path) -> None:
    """A whole D-PSGD-FT run (dense gossip on a ring, unequal clients, fine-tuning after the last round): each
    client's fine-tuned model is one epoch of plain SGD, on the client's own data, from the plain average of all
    clients' final models — computed here from ``personal_state`` (the clients' gossip models), not from the
    callback."""
    ft = FineTune(epochs=1, start="consensus")
    loop = tiny_loop(tmp_path, num_rounds=ROUNDS, topology=Ring(), callbacks=[Gossip(), ft])
    loop.fit(tiny_module(), tiny_datamodule(num_clients=CLIENTS, quantity_skew=True))
    dm = tiny_datamodule(num_clients=CLIENTS, quantity_skew=True)
    dm.setup("fit")
    assert len({dm.num_samples(k) for k in range(CLIENTS)}) > 1  # unequal clients
    personal = [loop.personal_state(k) for k in range(CLIENTS)]
    consensus = {n: sum(p[n].double() for p in personal).div(CLIENTS).float() for n in personal[0]}
    assert any(not torch.equal(consensus[n], personal[0][n]) for n in consensus)  # the models differ
    t = ROUNDS - 1
    for k in range(CLIENTS):
        seed = loop.streams.fit_seed("finetune", t, k)
        want = plain_masked_epoch(consensus, {}, dm.train_loader(k, seed=seed), seed, LR)
        got = ft.get_client_state(loop, k, "weights")
        assert got.keys() == want.keys()
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6)
