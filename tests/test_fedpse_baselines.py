"""FedPSE's baselines: FedSTC (ternary top-k up and down, error feedback on both sides) and FedSCR (structure-based
upstream pruning with residuals) — their tensor maths on hand-made tensors, two-round federations against plain
re-implementations written here, bytes, resume of the server's residual, bad options, the configs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TINY_CLI, fit_rows, fit_until_interrupted, tiny_datamodule, tiny_loop, tiny_module
from test_fedpse import _train

from pl_fedsparse import ConfigError, FederatedCallback
from pl_fedsparse.callbacks import (
    ElementwiseAggregation,
    PersonalizedDownstream,
    SparseDownstream,
    StructuredUpload,
    TopKUpload,
)
from pl_fedsparse.functional import (
    message_nbytes,
    sparse_nbytes,
    structured_mask,
    ternarize,
    ternary_nbytes,
    topk_sparsify,
    weighted_average,
)
from pl_fedsparse.streams import Streams

REPO = Path(__file__).resolve().parents[1]
P = 0.8


# --------------------------------------------------------------------------------------------- tensor maths
def test_ternarize_keeps_signs_and_the_mean_magnitude() -> None:
    x = torch.tensor([[0.0, -4.0], [1.0, 1.0]])
    t = ternarize(x)
    assert t.tolist() == [[0.0, -2.0], [2.0, 2.0]]
    assert torch.equal(ternarize(torch.zeros(3)), torch.zeros(3))


def test_structured_mask_drops_whole_filters_and_channels() -> None:
    x = torch.zeros(3, 2, 2, 2)  # 3 filters x 2 channels x 2 x 2
    x[0, 0] = 1.0  # filter 0 sum 4 (channel 0), filter 1 sum 8 over both channels, filter 2 sum 0.4
    x[1] = 1.0
    x[2, 1] = 0.1
    m = structured_mask(x, threshold=3.0)  # filter sums 4, 8, 0.4; channel sums 8, 4.4
    assert m[0].all() and m[1].all() and not m[2].any()
    m = structured_mask(x, threshold=4.5)  # filter 0 (4) and channel 1 (4.4) fall
    assert m[1, 0].all() and not m[1, 1].any() and not m[0].any() and not m[2].any()


def test_structured_mask_with_a_budget_takes_the_smallest_threshold_within_it() -> None:
    torch.manual_seed(0)
    x = torch.randn(16, 8, 3, 3) * torch.rand(16, 1, 1, 1) * torch.rand(1, 8, 1, 1)
    for p in (0.5, 0.8, 0.9):
        m = structured_mask(x, sparsity=p)
        budget = round((1 - p) * x.numel())
        assert 0 < int(m.sum()) <= budget
        rows = x.abs().sum(dim=(1, 2, 3))
        cols = x.abs().sum(dim=(0, 2, 3))
        # the next smaller candidate threshold would exceed the budget
        tau = min(float(rows[m.any(dim=(1, 2, 3))].min()), float(cols[m.any(dim=(0, 2, 3))].min()))
        lower = torch.cat([rows, cols])
        lower = lower[lower < tau]
        if lower.numel():
            assert int(structured_mask(x, threshold=float(lower.max())).sum()) > budget
    with pytest.raises(ConfigError, match="threshold/sparsity"):
        structured_mask(x)
    with pytest.raises(ConfigError, match=r"x.dim\(\)=1"):
        structured_mask(torch.ones(4), sparsity=0.5)


def test_ternary_bytes() -> None:
    assert ternary_nbytes(1000, 10) == 4 + 2 + 40
    assert ternary_nbytes(1000, 500) == 4 + 63 + 125
    t = {"w": ternarize(topk_sparsify(torch.randn(100), 0.9))}
    m = {"w": t["w"] != 0}
    assert message_nbytes(t, m, ternary={"w"}) == ternary_nbytes(100, 10) < message_nbytes(t, m) == sparse_nbytes(
        100, 10)


# --------------------------------------------------------------------------------------------- FedSTC
def fedstc() -> list[FederatedCallback]:
    return [TopKUpload(sparsity=P, quantize="ternary"), ElementwiseAggregation(mode="mean"),
            SparseDownstream(sparsity=P)]


def test_fedstc_two_rounds_equal_a_plain_implementation(tmp_path: Path) -> None:
    """Sattler et al. Alg. 2: clients send STC(ΔW + A), keep A; the server computes ΔW = R + mean, sends STC(ΔW) to
    everyone, keeps R; every client adds what it received."""
    rounds, clients = 2, 3
    loop = tiny_loop(tmp_path, num_rounds=rounds, callbacks=fedstc())
    loop.fit(tiny_module(), tiny_datamodule(num_clients=clients))
    dm = tiny_datamodule(num_clients=clients)
    dm.setup("fit")
    streams = Streams(loop.seed)
    w = {k: v.clone() for k, v in tiny_module().state_dict().items()}
    acc = {i: {k: torch.zeros_like(v) for k, v in w.items()} for i in range(clients)}
    res = {k: torch.zeros_like(v) for k, v in w.items()}
    for r in range(rounds):
        ups, ns = [], []
        for i in range(clients):
            seed = streams.fit_seed("train", r, i)
            trained, n = _train(w, dm.train_loader(i, seed=seed), seed, lr=0.1)
            up = {}
            for k in w:
                full = trained[k] - w[k] + acc[i][k]
                up[k] = ternarize(topk_sparsify(full, P))
                acc[i][k] = full - up[k]
            ups.append(up)
            ns.append(n)
        mean = weighted_average(ups, ns)
        down = {}
        for k in w:
            full = res[k] + mean[k]
            down[k] = ternarize(topk_sparsify(full, P))
            res[k] = full - down[k]
            w[k] = w[k] + down[k]
    for i in range(clients):
        for k, v in loop.personal_state(i).items():
            torch.testing.assert_close(v, w[k], rtol=1e-5, atol=1e-6)
    # the server's model is the clients' plus its residual
    for k, v in loop.global_state.items():  # type: ignore[union-attr]
        torch.testing.assert_close(v, w[k] + res[k], rtol=1e-5, atol=1e-6)


def test_fedstc_bytes_are_ternary_both_ways(tmp_path: Path) -> None:
    loop = tiny_loop(tmp_path, num_rounds=2, callbacks=fedstc())
    loop.fit(tiny_module(), tiny_datamodule())
    shapes = [v.numel() for v in loop.initial_state.values()]
    one = sum(ternary_nbytes(n, max(1, round((1 - P) * n))) for n in shapes)
    assert loop.history[0]["comm_bytes_up"] == 4 * one  # 4 clients, ternary top-k of every tensor
    assert loop.history[1]["comm_bytes_down"] == 4 * one  # round 0's broadcast, received at round 1's start


def test_fedstc_server_residual_survives_a_resume(tmp_path: Path) -> None:
    full = tiny_loop(tmp_path / "full", num_rounds=3, callbacks=fedstc())
    full.fit(tiny_module(), tiny_datamodule())
    cut = tiny_loop(tmp_path / "cut", num_rounds=3, callbacks=fedstc())
    fit_until_interrupted(cut, 2, tiny_module(), tiny_datamodule())
    resumed = tiny_loop(tmp_path / "cut", num_rounds=3, callbacks=fedstc())
    resumed.fit(tiny_module(), tiny_datamodule(), ckpt_path=str(tmp_path / "cut" / "checkpoints" / "last.ckpt"))
    a, b = full.callbacks[-1], resumed.callbacks[-1]
    assert any(bool(t.any()) for t in a.server_residual.values())  # type: ignore[attr-defined]
    for k, v in a.server_residual.items():  # type: ignore[attr-defined]
        assert torch.equal(v, b.server_residual[k])  # type: ignore[attr-defined]
    for k, v in full.personal_state(0).items():
        assert torch.equal(v, resumed.personal_state(0)[k])


# --------------------------------------------------------------------------------------------- FedSCR
def test_fedscr_two_rounds_equal_a_plain_implementation(tmp_path: Path) -> None:
    """Wu et al.: every client starts from the server's model, uploads its update (plus residual) with the weak
    filters/channels dropped into the residual, biases whole; the server adds the sample-weighted mean."""
    rounds, clients = 2, 3
    loop = tiny_loop(tmp_path, num_rounds=rounds,
                     callbacks=[StructuredUpload(sparsity=P), ElementwiseAggregation(mode="mean")])
    loop.fit(tiny_module(), tiny_datamodule(num_clients=clients))
    dm = tiny_datamodule(num_clients=clients)
    dm.setup("fit")
    streams = Streams(loop.seed)
    w = {k: v.clone() for k, v in tiny_module().state_dict().items()}
    res = {i: {k: torch.zeros_like(v) for k, v in w.items()} for i in range(clients)}
    sent_density = []
    for r in range(rounds):
        ups, ns = [], []
        for i in range(clients):
            seed = streams.fit_seed("train", r, i)
            trained, n = _train(w, dm.train_loader(i, seed=seed), seed, lr=0.1)
            up = {}
            for k in w:
                full = trained[k] - w[k] + res[i][k]
                if full.dim() < 2:
                    up[k] = full
                    continue
                keep = structured_mask(full, sparsity=P)
                up[k], res[i][k] = full * keep, full * ~keep
                sent_density.append(float(keep.float().mean()))
            ups.append(up)
            ns.append(n)
        mean = weighted_average(ups, ns)
        w = {k: w[k] + mean[k] for k in w}
    for i in range(clients):
        for k, v in loop.personal_state(i).items():
            torch.testing.assert_close(v, w[k], rtol=1e-5, atol=1e-6)
    assert max(sent_density) <= 1 - P + 1e-6


def test_fedscr_uploads_are_structured_and_downloads_dense(tmp_path: Path) -> None:
    loop = tiny_loop(tmp_path, num_rounds=2, callbacks=[StructuredUpload(sparsity=P),
                                                        ElementwiseAggregation(mode="mean")])
    loop.fit(tiny_module(), tiny_datamodule())
    dense = 4 * sum(v.numel() for v in loop.initial_state.values())
    assert 0 < loop.history[0]["comm_bytes_up"] < 4 * 0.5 * dense
    assert loop.history[1]["comm_bytes_down"] == 4 * dense  # the server's dense model to 4 clients


# --------------------------------------------------------------------------------------------- options and configs
def test_bad_options_are_one_line_config_errors() -> None:
    with pytest.raises(ConfigError, match="PersonalizedDownstream.personalized is invalid"):
        PersonalizedDownstream(quantize="ternary")
    with pytest.raises(ConfigError, match="TopKUpload.quantize='binary'"):
        TopKUpload(quantize="binary")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="StructuredUpload.sparsity/threshold"):
        StructuredUpload(sparsity=0.9, threshold=1.0)
    with pytest.raises(ConfigError, match="StructuredUpload.sparsity=1.5"):
        StructuredUpload(sparsity=1.5)


@pytest.mark.parametrize("method", ["fedstc", "fedscr"])
@pytest.mark.slow
def test_fmnist_configs_run_on_the_synthetic_task(method: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(REPO)
    rows = fit_rows(["--config", f"configs/fmnist_{method}.yaml", *TINY_CLI, "--data.root", "null",
                     "--data.max_train_samples", "null", "--trainer.num_rounds", "2", "--trainer.eval_every", "1",
                     "--trainer.default_root_dir", str(tmp_path / "run")], capsys)
    assert len(rows) == 2 and rows[-1]["comm_cum_bytes_total"] > 0
