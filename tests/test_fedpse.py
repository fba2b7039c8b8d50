"""FedPSE's callbacks (TopKUpload = UPS, ElementwiseAggregation = EWA, PersonalizedDownstream = DPS) in federations:
a full run checked against a plain re-implementation of Alg. 4, the ablations, partial participation, bytes, CLI."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import fit_rows, tiny_datamodule, tiny_loop, tiny_module

from pl_fedsparse import ConfigError, FederatedCallback
from pl_fedsparse.callbacks import ElementwiseAggregation, PersonalizedDownstream, TopKUpload
from pl_fedsparse.functional import (
    correlation_distance,
    elementwise_average,
    error_feedback_topk,
    personalized_mask,
    topk_sparsify,
)
from pl_fedsparse.streams import Streams

REPO = Path(__file__).resolve().parents[1]
P = 0.8


def fedpse(**dps: Any) -> list[FederatedCallback]:
    return [TopKUpload(sparsity=P), ElementwiseAggregation(), PersonalizedDownstream(sparsity=P, **dps)]


def _train(start: dict[str, torch.Tensor], dm: Any, seed: int, lr: float) -> tuple[dict[str, torch.Tensor], int]:
    """One local epoch of plain SGD from ``start`` on the batches the engine's fit gets (same loader seed)."""
    module = tiny_module()
    module.load_state_dict(start)
    opt = torch.optim.SGD(module.parameters(), lr=lr)
    torch.manual_seed(seed)
    n = 0
    for x, y in dm:
        opt.zero_grad()
        F.cross_entropy(module(x), y).backward()
        opt.step()
        n += int(y.shape[0])
    return {k: v.detach().clone() for k, v in module.state_dict().items()}, n


def test_two_rounds_equal_a_plain_implementation_of_algorithm_4(tmp_path: Path) -> None:
    rounds, clients = 2, 3
    loop = tiny_loop(tmp_path, num_rounds=rounds, callbacks=fedpse())
    loop.fit(tiny_module(), tiny_datamodule(num_clients=clients))
    dm = tiny_datamodule(num_clients=clients)
    dm.setup("fit")
    streams = Streams(loop.seed)
    w0 = {k: v.clone() for k, v in tiny_module().state_dict().items()}
    base = {i: dict(w0) for i in range(clients)}
    pend = {i: {k: torch.zeros_like(v) for k, v in w0.items()} for i in range(clients)}
    resid = {i: {k: torch.zeros_like(v) for k, v in w0.items()} for i in range(clients)}
    for r in range(rounds):
        ups, ns = {}, {}
        for i in range(clients):  # Alg. 1 (UPS)
            start = {k: base[i][k] + pend[i][k] for k in w0}
            seed = streams.fit_seed("train", r, i)
            trained, ns[i] = _train(start, dm.train_loader(i, seed=seed), seed, lr=0.1)
            sent = {}
            for k in w0:
                sent[k], resid[i][k] = error_feedback_topk(trained[k] - start[k], resid[i][k], P)
            ups[i], base[i] = sent, start
        dense = {k: elementwise_average([ups[i][k] for i in range(clients)], [ns[i] for i in range(clients)])
                 for k in w0}  # Alg. 2 (EWA)
        sparse = {k: topk_sparsify(v, P) for k, v in dense.items()}
        for i in range(clients):  # Alg. 3 (DPS)
            gen = streams.generator("dps", r, i)
            pend[i] = {k: dense[k] * personalized_mask(sparse[k] != 0, ups[i][k] != 0,
                                                       correlation_distance(sparse[k], ups[i][k]), gen).float()
                       for k in w0}
    for i in range(clients):
        mine = loop.personal_state(i)
        for k in w0:
            torch.testing.assert_close(mine[k], base[i][k] + pend[i][k], rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(loop.personal_state(0)[k], loop.personal_state(1)[k]) for k in w0)  # personalised


def test_without_dps_every_client_gets_the_same_update(tmp_path: Path) -> None:
    loop = tiny_loop(tmp_path, num_rounds=2, callbacks=fedpse(personalized=False))
    loop.fit(tiny_module(), tiny_datamodule())
    for i in range(1, 4):
        for k, v in loop.personal_state(0).items():
            assert torch.equal(v, loop.personal_state(i)[k])


def test_uploads_are_sparse_and_counted_so(tmp_path: Path) -> None:
    loop = tiny_loop(tmp_path, num_rounds=2, callbacks=fedpse())
    loop.fit(tiny_module(), tiny_datamodule())
    dense = 4 * sum(v.numel() for v in loop.initial_state.values())
    up = [r["comm_bytes_up"] for r in loop.history]
    assert all(0 < b < 4 * (0.5 * dense) for b in up)  # 4 clients, 20 % of the values + their indices each
    assert loop.history[0]["comm_bytes_down"] == 0  # nothing pending before the first round


def test_a_client_that_missed_rounds_catches_up(tmp_path: Path) -> None:
    seen: dict[str, Any] = {}

    class Grab(FederatedCallback):
        def on_after_aggregate(self, lp):  # type: ignore[no-untyped-def]
            seen[lp.round_idx] = ({k: v.clone() for k, v in lp.server_update.items()}, lp.select_clients(lp.round_idx))

    dps = PersonalizedDownstream(sparsity=P)
    loop = tiny_loop(tmp_path, num_rounds=2, clients_per_round=1,
                     callbacks=[TopKUpload(sparsity=P), ElementwiseAggregation(), Grab(), dps])
    loop.fit(tiny_module(), tiny_datamodule())
    missed = [k for k in range(4) if k not in seen[0][1] and k not in seen[1][1]]
    assert missed
    k = missed[0]
    pending = dps.get_client_state(loop, k, "pending")
    for name, v in pending.items():  # both rounds' global sparse updates, accumulated
        expected = topk_sparsify(seen[0][0][name], P) + topk_sparsify(seen[1][0][name], P)
        torch.testing.assert_close(v, expected)


def test_ewa_needs_update_uploads(tmp_path: Path) -> None:
    loop = tiny_loop(tmp_path, num_rounds=1, callbacks=[ElementwiseAggregation()])
    with pytest.raises(ConfigError, match="ElementwiseAggregation aggregates updates"):
        loop.fit(tiny_module(), tiny_datamodule())
    with pytest.raises(ConfigError, match="TopKUpload.sparsity=1.0"):
        TopKUpload(sparsity=1.0)


@pytest.mark.slow
def test_synthetic_fedpse_config_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(REPO)
    rows = fit_rows(["--config", "configs/synthetic_fedpse.yaml", "--trainer.num_rounds", "2", "--data.num_clients",
                     "6", "--trainer.default_root_dir", str(tmp_path / "run")], capsys)
    assert rows[-1]["acc_mean"] > 0.3 and rows[-1]["comm_cum_bytes_total"] > 0
