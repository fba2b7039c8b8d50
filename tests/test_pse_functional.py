"""FedPSE's tensor maths (pl_fedsparse.functional.pse) on hand-made tensors: EWA, top-k with error feedback, DPS."""

from __future__ import annotations

import pytest
import torch

from pl_fedsparse.functional import (correlation_distance, elementwise_average, error_feedback_topk,
                                     personalized_mask, topk_sparsify, weighted_average)


def test_ewa_element_sent_by_all_some_one_none() -> None:
    a = torch.tensor([[1.0, 4.0], [0.0, 0.0]])
    b = torch.tensor([[3.0, 0.0], [5.0, 0.0]])
    c = torch.tensor([[2.0, 1.0], [0.0, 0.0]])
    out = elementwise_average([a, b, c], [10.0, 30.0, 60.0])
    assert out[0, 0] == pytest.approx((10 * 1 + 30 * 3 + 60 * 2) / 100)  # all three
    assert out[0, 1] == pytest.approx((10 * 4 + 60 * 1) / 70)  # two of them: only their samples count
    assert out[1, 0] == pytest.approx(5.0)  # one: its value, whatever its weight
    assert out[1, 1] == 0.0  # nobody: zero, not NaN


def test_ewa_equals_fedavg_on_dense_updates() -> None:
    g = torch.Generator().manual_seed(0)
    ups = [torch.randn(5, 7, generator=g) + 3.0 for _ in range(4)]  # no exact zeros
    weights = [3.0, 1.0, 7.0, 2.0]
    fedavg = weighted_average([{"w": u} for u in ups], weights)["w"]
    torch.testing.assert_close(elementwise_average(ups, weights), fedavg)


def test_plain_mean_of_sparse_updates_differs_from_ewa() -> None:
    """Why EWA: averaging sparse updates over all clients shrinks an element sent by few."""
    ups = [torch.tensor([2.0, 0.0]), torch.tensor([0.0, 0.0])]
    assert elementwise_average(ups, [1, 1]).tolist() == [2.0, 0.0]
    assert weighted_average([{"w": u} for u in ups], [1, 1])["w"].tolist() == [1.0, 0.0]


@pytest.mark.parametrize("sparsity, kept", [(0.9, 5), (0.5, 25), (0.0, 50), (0.999, 1)])
def test_topk_keeps_the_largest_magnitudes(sparsity: float, kept: int) -> None:
    x = torch.linspace(-1, 1, 50)[torch.randperm(50, generator=torch.Generator().manual_seed(1))]
    out = topk_sparsify(x, sparsity)
    assert int((out != 0).sum()) == kept
    assert out.abs().max() == x.abs().max()
    if kept < 50:
        assert x[out == 0].abs().max() <= out[out != 0].abs().min()


def test_error_feedback_conserves_the_sum_of_updates_over_rounds() -> None:
    g = torch.Generator().manual_seed(2)
    residual = torch.zeros(40)
    raw_total, sent_total = torch.zeros(40, dtype=torch.float64), torch.zeros(40, dtype=torch.float64)
    for _ in range(12):
        raw = torch.randn(40, generator=g)
        sent, residual = error_feedback_topk(raw, residual, 0.9)
        assert int((sent != 0).sum()) == 4
        raw_total += raw.double()
        sent_total += sent.double()
    torch.testing.assert_close(sent_total + residual.double(), raw_total, rtol=0, atol=1e-5)


def test_correlation_distance() -> None:
    a = torch.tensor([1.0, 2.0, 0.0])
    assert correlation_distance(a, 3 * a) == pytest.approx(0.0)
    assert correlation_distance(a, -a) == pytest.approx(1.0)
    assert correlation_distance(a, torch.tensor([0.0, 0.0, 5.0])) == pytest.approx(0.5)  # orthogonal
    assert correlation_distance(a, torch.zeros(3)) == 0.5


@pytest.mark.parametrize("d, from_client, from_server", [(0.0, 0, 4), (0.5, 2, 2), (1.0, 4, 0)])
def test_dps_index_counts_and_the_intersection_is_kept(d: float, from_client: int, from_server: int) -> None:
    server = torch.zeros(20, dtype=torch.bool)
    client = torch.zeros(20, dtype=torch.bool)
    server[:6] = True  # k = 6
    client[4:12] = True  # intersection = {4, 5}: k_in = 2, so 4 more indices are chosen
    for seed in range(5):
        m = personalized_mask(server, client, d, torch.Generator().manual_seed(seed))
        assert m[4] and m[5]  # M_s ∩ M_i always kept
        assert int(m[6:12].sum()) == from_client  # from M_i − M_in
        assert int(m[:4].sum()) == from_server  # from M_s − M_in
        assert not m[12:].any()
        assert int(m.sum()) == 6


def test_dps_caps_at_the_available_indices_and_is_seeded() -> None:
    server = torch.tensor([True] * 6 + [False] * 4)
    client = torch.tensor([False] * 6 + [True] + [False] * 3)  # only one index of its own
    m = personalized_mask(server, client, 1.0, torch.Generator().manual_seed(0))
    assert int(m.sum()) == 1 and bool(m[6])  # d = 1 asks for 6 from the client: only 1 exists
    a = personalized_mask(server, client, 0.5, torch.Generator().manual_seed(3))
    b = personalized_mask(server, client, 0.5, torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
