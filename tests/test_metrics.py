"""Metric definitions and accounting on hand-made numbers."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pl_fedsparse import Message
from pl_fedsparse.functional import message_nbytes, sparse_nbytes
from pl_fedsparse.functional.aggregation import masked_weighted_average
from pl_fedsparse.metrics import SERVER, CommLedger, TrainFlops, bottom_decile, summarize_accuracies


def test_bottom_decile_is_floor_n_over_10_th_worst() -> None:
    accs = [i / 100 for i in range(100, 0, -1)]  # 1.00 ... 0.01, N = 100
    assert bottom_decile(accs) == pytest.approx(0.11)  # sorted ascending, index 10
    assert bottom_decile([0.5] * 9 + [0.1]) == pytest.approx(0.5)  # N = 10 -> index 1: the worst is skipped
    assert bottom_decile([0.7, 0.2, 0.9]) == pytest.approx(0.2)  # N < 10 -> the worst
    assert math.isnan(bottom_decile([]))


def test_weighted_mean_and_std() -> None:
    s = summarize_accuracies([0.9, 0.6, 0.3], [10, 20, 70])
    assert s["acc_mean"] == pytest.approx(0.6)
    assert s["acc_weighted"] == pytest.approx((9 + 12 + 21) / 100)
    assert s["acc_std"] == pytest.approx(math.sqrt((0.09 + 0 + 0.09) / 3))


def test_byte_accounting_of_a_known_message() -> None:
    w = torch.randn(100, 10)           # 1000 values
    b = torch.randn(10)
    m = torch.zeros(100, 10, dtype=torch.bool)
    m[:5] = True                       # 50 non-zeros: the 125 B bitmap beats 200 B of int32 indices
    msg = Message({"w": w * m, "b": b}, {"w": m})
    assert msg.nbytes() == (50 * 4 + min(125, 200)) + 10 * 4
    m2 = torch.zeros(100, 10, dtype=torch.bool)
    m2[0, :3] = True                   # 3 non-zeros: 12 B of int32 indices beat the 125 B bitmap
    assert message_nbytes({"w": w * m2}, {"w": m2}) == 3 * 4 + 12
    assert message_nbytes({"w": w.half()}) == 4000   # float32 on the wire whatever the training dtype
    assert message_nbytes({}, {"mask": m}) == 125      # a bare mask travels as its bitmap
    assert sparse_nbytes(8, 8) == 32 + 1


def test_ledger_star_and_busiest_node() -> None:
    led = CommLedger()
    for k in range(3):
        led.record(SERVER, k, 100)
        led.record(k, SERVER, 10 * (k + 1))
    r = led.end_round()
    assert (r["comm_bytes_down"], r["comm_bytes_up"], r["comm_bytes_total"]) == (300, 60, 360)
    assert r["comm_busiest_node_bytes"] == 360 and r["comm_busiest_client_bytes"] == 130
    led.record(0, 1, 5)  # a peer link: a send and a receive, one transfer
    r2 = led.end_round()
    assert (r2["comm_bytes_up"], r2["comm_bytes_down"], r2["comm_bytes_total"]) == (5, 5, 5)
    assert r2["comm_cum_bytes_total"] == 365


def test_train_flops_counts_forward_and_backward_and_scales_masked_layers() -> None:
    net = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
    tf = TrainFlops(net, torch.zeros(5, 8))
    fwd = 2 * 8 * 4 + 2 * 4 * 2
    # backward: grad wrt weights for both layers, grad wrt input only for the 2nd layer's input
    assert tf.per_sample() == pytest.approx(fwd + (2 * 8 * 4) + 2 * (2 * 4 * 2))
    half = tf.per_sample({"0.weight": 0.5})
    assert half == pytest.approx(tf.per_sample() - 0.5 * tf.layer_flops["0.weight"])


def test_masked_average_keeps_fallback_where_nobody_holds() -> None:
    v = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([5.0, 6.0, 7.0])]
    masks = [torch.tensor([True, True, False]), torch.tensor([False, True, False])]
    out = masked_weighted_average(v, [1, 1], masks, fallback=torch.tensor([0.0, 0.0, -1.0]))
    torch.testing.assert_close(out, torch.tensor([1.0, 4.0, -1.0]))


def test_ledger_in_out_and_links() -> None:
    led = CommLedger()
    led.record(0, 1, 10)
    led.record(2, 1, 30)
    led.record(1, 0, 5)
    r = led.end_round()
    assert r["comm_links"] == 3 and r["comm_bytes_per_link"] == pytest.approx(15.0)
    assert r["comm_busiest_node_in_bytes"] == 40   # node 1 receives 10 + 30
    assert r["comm_busiest_node_out_bytes"] == 30  # node 2 sends 30
    assert r["comm_busiest_node_bytes"] == 45      # node 1: 40 in + 5 out
