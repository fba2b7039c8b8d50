"""Dynamic sparse training (MaskPruneRegrow) and FedSpa's aggregation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import tiny_datamodule, tiny_loop, tiny_module
from pl_fedsparse import ClientUpdate, ConfigError, FederatedCallback
from pl_fedsparse.callbacks import FedSpaAggregation, GradientRegrow, RandomRegrow, SparseMask
from pl_fedsparse.functional import apply_masks


class Grab(FederatedCallback):
    def __init__(self) -> None:
        self.rounds: list[list[ClientUpdate]] = []

    def on_before_aggregate(self, loop, updates):  # type: ignore[no-untyped-def]
        self.rounds.append(list(updates))


def _equal_sizes_dm(**kw: Any):  # type: ignore[no-untyped-def]
    return tiny_datamodule(partition="iid", **kw)  # 400 samples over 4 clients: 100 each


@pytest.mark.slow
def test_fedspa_with_all_ones_masks_equals_fedavg(tmp_path: Path) -> None:
    spa = tiny_loop(tmp_path / "s", num_rounds=2, clients_per_round=3,
                    callbacks=[SparseMask(density=1.0), FedSpaAggregation()])
    spa.fit(tiny_module(), _equal_sizes_dm())
    avg = tiny_loop(tmp_path / "a", num_rounds=2, clients_per_round=3)
    avg.fit(tiny_module(), _equal_sizes_dm())
    for k, v in avg.global_state.items():  # type: ignore[union-attr]
        torch.testing.assert_close(spa.global_state[k], v, rtol=1e-5, atol=1e-6)  # type: ignore[index]
    # sample weighting: exactly FedAvg whatever the client sizes
    spa2 = tiny_loop(tmp_path / "s2", num_rounds=1, callbacks=[SparseMask(density=1.0),
                                                              FedSpaAggregation(weighting="samples")])
    spa2.fit(tiny_module(), tiny_datamodule())
    avg2 = tiny_loop(tmp_path / "a2", num_rounds=1)
    avg2.fit(tiny_module(), tiny_datamodule())
    for k, v in avg2.global_state.items():  # type: ignore[union-attr]
        torch.testing.assert_close(spa2.global_state[k], v, rtol=1e-5, atol=1e-6)  # type: ignore[index]


def test_fedspa_eq4_divides_by_participants() -> None:
    agg = FedSpaAggregation()

    class L:  # the loop surface aggregate() uses
        global_state = {"w": torch.tensor([1.0, 1.0, 1.0, 1.0])}

    m0 = torch.tensor([True, True, False, False])
    m1 = torch.tensor([False, True, True, False])
    u0 = ClientUpdate(0, 0, 10, {"w": torch.tensor([0.0, 0.5, 0.0, 0.0])}, masks={"w": m0})
    u1 = ClientUpdate(1, 0, 30, {"w": torch.tensor([0.0, 0.0, 3.0, 0.0])}, masks={"w": m1})
    out = agg.aggregate(L(), [u0, u1])  # type: ignore[arg-type]
    # U0 = [1, .5, 0, 0], U1 = [0, 1, -2, 0]; W - (U0 + U1)/2
    torch.testing.assert_close(out["w"], torch.tensor([0.5, 0.25, 2.0, 1.0]))  # type: ignore[index]


@pytest.mark.parametrize("cls", [GradientRegrow, RandomRegrow])
def test_prune_regrow_keeps_counts_changes_masks_and_warm_starts(tmp_path: Path, cls: type) -> None:
    grab = Grab()
    dst = cls(density=0.4, alpha0=0.5)
    loop = tiny_loop(tmp_path, num_rounds=3, clients_per_round=2, callbacks=[dst, FedSpaAggregation(), grab])
    loop.fit(tiny_module(), tiny_datamodule())
    first = dst.draw_mask(loop, 0)
    for rnd in grab.rounds:
        for u in rnd:
            nxt = u.extras["next_mask"]
            for name, m in u.masks.items():
                assert int(nxt[name].sum()) == int(m.sum())  # exact count
            assert any(not torch.equal(nxt[n], u.masks[n]) for n in nxt)  # the mask moved
    sampled = {u.client_idx for rnd in grab.rounds for u in rnd}
    for k in range(4):  # clients never sampled keep their initial mask
        cur = dst.masks(loop, k)
        if k not in sampled:
            assert all(torch.equal(cur[n], first[n]) for n in cur)
    # a regrown coordinate starts from the dense global value: the next download is m_{k,t+1} ⊙ W
    k = grab.rounds[-1][0].client_idx
    msg = loop.client_message(k)
    for n, m in dst.masks(loop, k).items():
        torch.testing.assert_close(msg.tensors[n], loop.global_state[n] * m)  # type: ignore[union-attr, index]


def test_cosine_rate_schedule_and_validation(tmp_path: Path) -> None:
    dst = RandomRegrow(alpha0=0.5, total_rounds=10)
    loop = tiny_loop(tmp_path, num_rounds=10)
    assert dst.prune_rate(loop, 0) == pytest.approx(0.5)
    assert dst.prune_rate(loop, 5) == pytest.approx(0.25)
    assert RandomRegrow(alpha0=0.1, schedule="constant", every_n_rounds=10).prune_rate(loop, 10) == 0.1
    assert RandomRegrow(alpha0=0.1, schedule="constant", every_n_rounds=10).prune_rate(loop, 11) == 0.0
    with pytest.raises(ConfigError, match="RandomRegrow.alpha0=1.5"):
        RandomRegrow(alpha0=1.5)
    with pytest.raises(ConfigError, match="GradientRegrow.density=1.5"):
        GradientRegrow(density=1.5)


def test_gradient_regrow_charges_its_dense_batch(tmp_path: Path) -> None:
    static = tiny_loop(tmp_path / "s", num_rounds=1, callbacks=[SparseMask(density=0.4)])
    s = static.fit(tiny_module(), tiny_datamodule())
    grad = tiny_loop(tmp_path / "g", num_rounds=1, callbacks=[GradientRegrow(density=0.4)])
    g = grad.fit(tiny_module(), tiny_datamodule())
    extra = g["flops_train_cum"] - s["flops_train_cum"]
    assert extra == pytest.approx(4 * 16 * grad.accounting.flops_per_sample())  # 4 clients x one batch of 16


def test_dst_resume_is_identical(tmp_path: Path) -> None:
    def make(d: Path, rounds: int):  # type: ignore[no-untyped-def]
        return tiny_loop(d, num_rounds=rounds, clients_per_round=2,
                         callbacks=[RandomRegrow(density=0.4, total_rounds=4), FedSpaAggregation()])

    full = make(tmp_path / "full", 4)
    full.fit(tiny_module(), tiny_datamodule())
    make(tmp_path / "cut", 2).fit(tiny_module(), tiny_datamodule())
    res = make(tmp_path / "cut", 4)
    res.fit(tiny_module(), tiny_datamodule(), ckpt_path=str(tmp_path / "cut/checkpoints/last.ckpt"))
    for k, v in full.global_state.items():  # type: ignore[union-attr]
        assert torch.equal(v, res.global_state[k])  # type: ignore[index]
    cb_full, cb_res = full.fed_callbacks[0], res.fed_callbacks[0]
    for k in range(4):
        a, b = cb_full.masks(full, k), cb_res.masks(res, k)  # type: ignore[attr-defined]
        assert all(torch.equal(a[n], b[n]) for n in a)


def test_masks_are_stored_bit_packed(tmp_path: Path) -> None:
    dst = RandomRegrow(density=0.4)
    loop = tiny_loop(tmp_path, num_rounds=1, callbacks=[dst])
    loop.fit(tiny_module(), tiny_datamodule())
    packed = dst.get_client_state(loop, 0, "mask")
    masks = dst.masks(loop, 0)
    for name, m in masks.items():
        assert packed[name].dtype == torch.uint8 and packed[name].numel() == (m.numel() + 7) // 8
    assert apply_masks({n: torch.ones(m.shape) for n, m in masks.items()}, masks)


def test_drop_scores_are_every_abs_weight_at_once_unless_drop_score_is_overridden() -> None:
    """The default drop score |w| of every masked tensor is taken by one multi-tensor ``abs`` (the same values as
    tensor by tensor, operators independent of the number of tensors); a subclass overriding ``drop_score`` still
    gets its own score for each tensor."""
    from conftest import count_operators

    g = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(3, 4, generator=g) for i in range(12)}
    update = ClientUpdate(0, 0, 1, state, metrics={})
    cb = RandomRegrow(density=0.5)
    names = list(state)
    got = cb.drop_scores(None, update, names)  # type: ignore[arg-type]
    assert all(torch.equal(got[n], state[n].abs()) for n in names)
    assert count_operators(lambda: cb.drop_scores(None, update, names[:2])) == \
        count_operators(lambda: cb.drop_scores(None, update, names))  # type: ignore[arg-type]

    class Squared(RandomRegrow):
        def drop_score(self, loop: Any, update: ClientUpdate, name: str, weight: torch.Tensor) -> torch.Tensor:
            return weight * weight

    mine = Squared(density=0.5).drop_scores(None, update, names)  # type: ignore[arg-type]
    assert all(torch.equal(mine[n], state[n] * state[n]) for n in names)
