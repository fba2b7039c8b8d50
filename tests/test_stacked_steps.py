"""``executors.stacked.sgd_step`` and ``adam_step``: torch.optim.SGD's and torch.optim.Adam's updates on stacked
tensors (one row a client), the tensors that share their hyper-parameters updated by multi-tensor operations — each
row the same bits as the client's own optimizer (single-tensor form) over several steps."""

from __future__ import annotations

import pytest
import torch
from conftest import count_operators

from pl_fedsparse.executors.stacked import ElementwiseOptim, adam_step, sgd_step

_SHAPES = {"a": (3, 4), "b": (5,), "c": (2, 2, 3), "d": ()}


@pytest.mark.parametrize("momentum,dampening,nesterov,wd", [(0.0, 0.0, False, 0.0), (0.9, 0.0, False, 5e-4),
                                                            (0.5, 0.1, False, 0.0), (0.9, 0.0, True, 1e-3)])
def test_each_row_is_its_clients_own_sgd(momentum: float, dampening: float, nesterov: bool, wd: float) -> None:
    rows, steps = 3, 4
    g = torch.Generator().manual_seed(1)
    start = {n: torch.randn(rows, *s, generator=g) for n, s in _SHAPES.items()}
    grads = [{n: torch.randn(rows, *s, generator=g) for n, s in _SHAPES.items()} for _ in range(steps)]
    lrs = {n: [0.1] * rows for n in _SHAPES}
    lrs["b"] = [0.1, 0.05, 0.2]  # (a learning rate per row: that tensor goes alone)
    hyper = {n: (momentum, dampening, nesterov, wd) for n in _SHAPES}
    hyper["c"] = (0.0, 0.0, False, 0.0)  # (other hyper-parameters: a group of its own)
    optim = ElementwiseOptim("sgd", {n: 0.1 for n in _SHAPES}, hyper)
    P = {n: t.clone() for n, t in start.items()}
    state: dict[str, dict[str, torch.Tensor]] = {n: {} for n in _SHAPES}
    for G in grads:
        sgd_step(P, {n: t.clone() for n, t in G.items()}, state, optim, lrs, torch.zeros(rows))
    for r in range(rows):
        params = {n: torch.nn.Parameter(start[n][r].clone()) for n in _SHAPES}
        opts = [torch.optim.SGD([params[n]], lr=lrs[n][r], momentum=hyper[n][0], dampening=hyper[n][1],
                                nesterov=hyper[n][2], weight_decay=hyper[n][3], foreach=False) for n in _SHAPES]
        for G in grads:
            for n in _SHAPES:
                params[n].grad = G[n][r].clone()
            for o in opts:
                o.step()
        for n in _SHAPES:  # ("b", with a learning rate per row, too: each row its own step)
            assert torch.equal(P[n][r], params[n].detach()), (n, r)


def test_a_step_costs_the_same_operators_for_any_number_of_tensors() -> None:
    def ops(count: int) -> int:
        names = [f"w{i}" for i in range(count)]
        P = {n: torch.randn(2, 4) for n in names}
        optim = ElementwiseOptim("sgd", {n: 0.1 for n in names}, {n: (0.9, 0.0, False, 5e-4) for n in names})
        state: dict[str, dict[str, torch.Tensor]] = {n: {} for n in names}
        lrs = {n: [0.1, 0.1] for n in names}
        sgd_step(P, {n: torch.randn(2, 4) for n in names}, state, optim, lrs, torch.zeros(2))  # (buffers made)
        G, steps = {n: torch.randn(2, 4) for n in names}, torch.zeros(2)
        return count_operators(lambda: sgd_step(P, G, state, optim, lrs, steps))

    assert ops(3) == ops(30) <= 6


def test_rows_whose_momentum_starts_now_take_the_gradient_as_their_buffer() -> None:
    """A continued fit's rows (``"fresh"`` False) keep their momentum; a row that has none yet (``"fresh"`` True)
    starts it from its gradient — each row equal to its client's own ``torch.optim.SGD``, with a buffer or without."""
    g = torch.Generator().manual_seed(4)
    start, kept = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    grads = [torch.randn(3, 5, generator=g) for _ in range(3)]
    hyper = (0.9, 0.0, False, 1e-3)
    P = {"w": start.clone()}
    state = {"w": {"momentum_buffer": kept.clone(), "fresh": torch.tensor([False, True, False])}}
    optim = ElementwiseOptim("sgd", {"w": 0.1}, {"w": hyper})
    for G in grads:
        sgd_step(P, {"w": G.clone()}, state, optim, {"w": [0.1] * 3}, torch.zeros(3))
    for r in range(3):
        w = torch.nn.Parameter(start[r].clone())
        opt = torch.optim.SGD([w], lr=0.1, momentum=0.9, weight_decay=1e-3, foreach=False)
        if r != 1:
            opt.state[w]["momentum_buffer"] = kept[r].clone()
        for G in grads:
            w.grad = G[r].clone()
            opt.step()
        assert torch.equal(P["w"][r], w.detach()), r


def _adam_rows(start: dict[str, torch.Tensor], grads: list[dict[str, torch.Tensor]], hyper: dict[str, tuple],
               lrs: dict[str, list[float]], counts: list[list[int]]) -> dict[str, torch.Tensor]:
    """The stacked Adam over ``grads`` (``counts[s]``: every row's step count at step ``s``)."""
    optim = ElementwiseOptim("adam", {n: 0.01 for n in start}, hyper)
    P = {n: t.clone() for n, t in start.items()}
    state: dict[str, dict[str, torch.Tensor]] = {n: {} for n in start}
    for G, c in zip(grads, counts, strict=True):
        adam_step(P, {n: t.clone() for n, t in G.items()}, state, optim, lrs, torch.tensor(c))
    return P


@pytest.mark.parametrize("beta1,beta2,eps,wd", [(0.9, 0.999, 1e-8, 0.0), (0.5, 0.9, 1e-3, 1e-2)])
@pytest.mark.parametrize("per_row", ["none", "lr", "steps"])
def test_each_row_is_its_clients_own_adam(beta1: float, beta2: float, eps: float, wd: float, per_row: str) -> None:
    """Every row equals its client's ``torch.optim.Adam(foreach=False)``: one learning rate and step count for all
    rows (multi-tensor operations), a learning rate per row, or rows at different step counts (a client that
    continued an earlier fit's moments: its bias corrections count from there)."""
    rows, steps = 3, 4
    g = torch.Generator().manual_seed(2)
    start = {n: torch.randn(rows, *s, generator=g) for n, s in _SHAPES.items()}
    grads = [{n: torch.randn(rows, *s, generator=g) for n, s in _SHAPES.items()} for _ in range(steps)]
    lrs = {n: [0.01] * rows for n in _SHAPES}
    if per_row == "lr":
        lrs["b"] = [0.01, 0.005, 0.02]
    hyper: dict[str, tuple] = {n: (beta1, beta2, eps, wd) for n in _SHAPES}
    hyper["c"] = (0.8, 0.99, 1e-6, 0.0)  # (other hyper-parameters: a group of its own)
    offset = [0, 5, 2] if per_row == "steps" else [0] * rows  # steps each row took before (moments zero here)
    P = _adam_rows(start, grads, hyper, lrs, [[o + s + 1 for o in offset] for s in range(steps)])
    for r in range(rows):
        params = {n: torch.nn.Parameter(start[n][r].clone()) for n in _SHAPES}
        opts = [torch.optim.Adam([params[n]], lr=lrs[n][r], betas=hyper[n][:2], eps=hyper[n][2],
                                 weight_decay=hyper[n][3], foreach=False) for n in _SHAPES]
        for o, n in zip(opts, _SHAPES, strict=True):
            if offset[r]:  # (its earlier steps: the count the bias corrections start from)
                o.state[params[n]] = {"step": torch.tensor(float(offset[r])),
                                      "exp_avg": torch.zeros_like(params[n]), "exp_avg_sq": torch.zeros_like(params[n])}
        for G in grads:
            for n in _SHAPES:
                params[n].grad = G[n][r].clone()
            for o in opts:
                o.step()
        for n in _SHAPES:
            assert torch.equal(P[n][r], params[n].detach()), (n, r)


def test_an_adam_step_costs_the_same_operators_for_any_number_of_tensors() -> None:
    def ops(count: int) -> int:
        names = [f"w{i}" for i in range(count)]
        P = {n: torch.randn(2, 4) for n in names}
        optim = ElementwiseOptim("adam", {n: 0.01 for n in names}, {n: (0.9, 0.999, 1e-8, 1e-3) for n in names})
        state: dict[str, dict[str, torch.Tensor]] = {n: {} for n in names}
        lrs = {n: [0.01, 0.01] for n in names}
        G, H = {n: torch.randn(2, 4) for n in names}, {n: torch.randn(2, 4) for n in names}
        first = count_operators(lambda: adam_step(P, H, state, optim, lrs, torch.tensor([1, 1])))
        counted = count_operators(lambda: adam_step(P, G, state, optim, lrs, torch.tensor([2, 2])))
        assert first == counted + 1  # (the moments made: one fill for them all)
        return counted

    assert ops(3) == ops(30) <= 8
