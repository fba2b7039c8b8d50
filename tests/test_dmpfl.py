"""DM-PFL (DualMask), FedDST and Ditto: Eq. 4, Eq. 5, the coverage rule, Phase 2's trained positions, resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import tiny_datamodule, tiny_loop, tiny_module

from pl_fedsparse import ClientUpdate, ConfigError, FederatedCallback
from pl_fedsparse.callbacks import Ditto, DualMask, FedDST
from pl_fedsparse.client import Message
from pl_fedsparse.functional.dual import compose_personal, mask_coverage, select_global_mask


# ---- Eq. 4 ------------------------------------------------------------------------------------------------------
def test_eq4_composition_on_hand_made_tensors() -> None:
    w_g = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    w_c = torch.tensor([[10.0, 20.0, 30.0], [40.0, 50.0, 60.0]])
    m_g = torch.tensor([[1, 1, 0], [0, 1, 0]], dtype=torch.bool)
    m_c = torch.tensor([[1, 0, 1], [0, 1, 1]], dtype=torch.bool)
    theta_c = compose_personal(w_g, m_g, w_c, m_c)
    # shared (m_g ∩ m_c) from w_g; personal (m_c − m_g) from w_c; zero outside m_c
    assert theta_c.tolist() == [[1.0, 0.0, 30.0], [0.0, 5.0, 60.0]]


def test_personal_state_is_eq4_of_the_stored_parts(tmp_path: Path) -> None:
    dm = DualMask(density=0.5, iterations=0)
    loop = tiny_loop(tmp_path, num_rounds=2, clients_per_round=2, callbacks=[dm])
    loop.fit(tiny_module(), tiny_datamodule())
    glob = loop.global_state
    assert glob is not None
    for k in range(4):
        m_c = dm.masks(loop, k)
        w_c = dm.personal_weights(loop, k, m_c)
        theta = loop.personal_state(k)
        for name, m in m_c.items():
            m_g = dm.global_mask[name]
            assert torch.equal(theta[name][m & m_g], glob[name][m & m_g])
            assert torch.equal(theta[name][m & ~m_g], w_c[name][m & ~m_g])
            assert not theta[name][~m].any()
        for name, v in theta.items():  # unmasked tensors (biases) are the shared global ones
            if name not in m_c:
                assert torch.equal(v, glob[name])


# ---- Eq. 5 and the global mask ----------------------------------------------------------------------------------
class _Loop:  # the loop surface DualMask.aggregate uses
    num_rounds = 10

    def __init__(self, w: torch.Tensor) -> None:
        self.global_state = {"w": w, "b": torch.zeros(2)}


def _upload(k: int, n: int, w: list[float], m: list[int], b: list[float]) -> ClientUpdate:
    mask = torch.tensor(m, dtype=torch.bool)
    vals = torch.tensor(w) * mask
    return ClientUpdate(k, 0, n, {}, message=Message({"w": vals, "b": torch.tensor(b)}, {"w": mask}))


def test_eq5_aggregation_with_uncovered_positions_and_the_new_global_mask() -> None:
    dm = DualMask(density=0.5, iterations=0, coverage_threshold=0.3)
    dm.global_mask = {"w": torch.tensor([True, True, False, False, False])}
    dm._counts = {"w": 2}
    loop = _Loop(torch.tensor([9.0, 9.0, 9.0, 9.0, -9.0]))
    ups = [_upload(0, 10, [1.0, 2.0, 0.0, 0.0, 0.0], [1, 1, 0, 0, 0], [1.0, 1.0]),
           _upload(1, 30, [3.0, 0.0, 4.0, 0.0, 0.0], [1, 0, 1, 0, 0], [3.0, 5.0]),
           _upload(2, 40, [5.0, 0.0, 0.0, 7.0, 0.0], [1, 0, 0, 1, 0], [0.0, 0.0]),
           _upload(3, 20, [2.0, 1.0, 0.0, 0.0, 0.0], [1, 1, 0, 0, 0], [2.0, 2.0])]
    new = dm.aggregate(loop, ups)  # type: ignore[arg-type]
    assert new is not None
    # position 0: all four, (10·1 + 30·3 + 40·5 + 20·2) / 100; 1: clients 0 and 3, (10·2 + 20·1) / 30;
    # 2: client 1 only; 3: client 2 only; 4 is held by nobody and keeps its old value (-9)
    torch.testing.assert_close(new["w"], torch.tensor([3.4, 4.0 / 3.0, 4.0, 7.0, -9.0]))
    torch.testing.assert_close(new["b"], torch.tensor([1.4, 2.0]))  # dense tensors: sample-weighted FedAvg
    # coverage 4/4, 2/4, 1/4, 1/4, 0/4: positions 2-4 are held by no more than 30 % of the sampled clients, so the
    # new m_g (2 positions) is {0, 1} although |w| is larger at positions 2, 3 and 4
    assert dm.global_mask["w"].tolist() == [True, True, False, False, False]
    # with the rule off, the top-2 magnitudes among held positions win (2 and 3); 4 (|-9|) is held by nobody
    dm2 = DualMask(density=0.5, iterations=0, coverage_threshold=0.0)
    dm2.global_mask, dm2._counts = {"w": torch.zeros(5, dtype=torch.bool)}, {"w": 2}
    dm2.aggregate(loop, ups)  # type: ignore[arg-type]
    assert dm2.global_mask["w"].tolist() == [False, False, True, True, False]  # position 4 is held by nobody


def test_coverage_rule_threshold_and_scope() -> None:
    cov = mask_coverage([torch.tensor([1, 1, 1, 0]), torch.tensor([1, 1, 0, 0]), torch.tensor([1, 0, 0, 1]),
                         torch.tensor([0, 1, 0, 1])])
    assert cov.tolist() == [3, 3, 1, 2]
    w = {"a": torch.tensor([0.1, 5.0, 9.0, 2.0])}
    # 10 clients, threshold 0.3: eligible iff held by > 3 — none; threshold 0.2: > 2 — positions 0, 1
    assert not select_global_mask(w, {"a": cov}, 10, {"a": 2}, threshold=0.3)["a"].any()
    assert select_global_mask(w, {"a": cov}, 10, {"a": 2}, threshold=0.2)["a"].tolist() == [True, True, False, False]
    # exactly at the threshold is excluded ("no more than 30 %"): 3 of 10 held
    assert not select_global_mask(w, {"a": torch.tensor([3, 3, 3, 3])}, 10, {"a": 4})["a"].any()
    # 4 clients, threshold 0.3: eligible iff held by > 1.2, i.e. positions 0, 1, 3; top 2 by |w|: 1 and 3
    assert select_global_mask(w, {"a": cov}, 4, {"a": 2})["a"].tolist() == [False, True, False, True]
    # model scope: one magnitude threshold over all tensors
    w2 = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([3.0, 4.0])}
    c2 = {"a": torch.tensor([2, 2]), "b": torch.tensor([2, 2])}
    out = select_global_mask(w2, c2, 2, {"a": 1, "b": 1}, scope="model")
    assert out["a"].tolist() == [False, False] and out["b"].tolist() == [True, True]
    out = select_global_mask(w2, c2, 2, {"a": 1, "b": 1}, scope="layer")
    assert out["a"].tolist() == [False, True] and out["b"].tolist() == [False, True]


def _global_mask_counting_first(weights: dict, coverage: dict, num_clients: int, counts: dict, threshold: float,
                                scope: str) -> dict:
    """The rule as first written: count the eligible positions on the host, then the top ``min(count, that)``."""
    eligible = {k: coverage[k] > threshold * num_clients for k in weights}
    score = {k: torch.where(eligible[k], w.abs().float(), torch.full_like(w, -1.0)).flatten() for k, w in weights.items()}
    out = {}
    if scope == "layer":
        for k, w in weights.items():
            n = min(counts[k], int(eligible[k].sum()))
            m = torch.zeros(w.numel(), dtype=torch.bool)
            if n > 0:
                m[torch.topk(score[k], n, sorted=False).indices] = True
            out[k] = m.view(w.shape)
        return out
    flat = torch.cat([score[k] for k in weights])
    n = min(sum(counts.values()), sum(int(e.sum()) for e in eligible.values()))
    keep = torch.zeros(flat.numel(), dtype=torch.bool)
    if n > 0:
        keep[torch.topk(flat, n, sorted=False).indices] = True
    return dict(zip(weights, (t.view(w.shape) for t, w in zip(keep.split([w.numel() for w in weights.values()]),
                                                                weights.values()))))


@pytest.mark.parametrize("scope", ["layer", "model"])
def test_the_global_mask_without_counting_on_the_host_is_the_same_set(scope: str) -> None:
    """The global mask taken as the top ``count`` with the ineligible dropped (no host read of how many are
    eligible) is the set the count-first rule picks: ties (magnitudes on a coarse grid), ±0, NaN, too few and
    enough eligible positions, counts of 0 and of the whole tensor."""
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        shapes = {"a": (7, 5), "b": (13,), "c": (2, 3, 4)}
        weights = {k: torch.randint(-3, 4, s, generator=g).float() / 2 for k, s in shapes.items()}
        if trial % 7 == 0:
            weights["a"].view(-1)[3] = float("nan")
        if trial % 5 == 0:
            weights["b"][0] = -0.0
        coverage = {k: torch.randint(0, 6, s, generator=g) for k, s in shapes.items()}
        counts = {k: int(torch.randint(0, int(torch.tensor(s).prod()) + 1, (1,), generator=g)) for k, s in
                  shapes.items()}
        got = select_global_mask(weights, coverage, 5, counts, threshold=0.3 + 0.1 * (trial % 4), scope=scope)
        want = _global_mask_counting_first(weights, coverage, 5, counts, 0.3 + 0.1 * (trial % 4), scope)
        for k in shapes:
            assert torch.equal(got[k], want[k]), (trial, k)


def test_the_global_mask_reads_nothing_on_the_host() -> None:
    """No value of the aggregated weights or the coverage is read on the host (a wait per tensor on a device):
    planted: the count-first rule reads them."""
    from pl_fedsparse.functional import dual

    reads = []
    real = torch.Tensor.__int__

    def spy(t: torch.Tensor) -> int:
        reads.append(1)
        return real(t)

    w = {"a": torch.tensor([0.1, 5.0, 9.0, 2.0])}
    cov = {"a": torch.tensor([3, 3, 1, 2])}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "__int__", spy)
        mp.setattr(torch.Tensor, "__bool__", lambda t: reads.append(1) or True)
        mp.setattr(torch.Tensor, "item", lambda t: reads.append(1))
        dual.select_global_mask(w, cov, 4, {"a": 2})
        assert not reads
        _global_mask_counting_first(w, cov, 4, {"a": 2}, 0.3, "layer")
        assert reads


# ---- schedule -----------------------------------------------------------------------------------------------------
def test_phase_schedule(tmp_path: Path) -> None:
    loop = tiny_loop(tmp_path, num_rounds=8)
    dm = DualMask(iterations=2)
    assert [dm.phase(loop, r) for r in range(8)] == ["mask"] * 2 + ["global"] * 2 + ["mask"] * 2 + ["global"] * 2
    assert [r for r in range(8) if dm.refines_personal_after(loop, r)] == [3, 7]
    dm0 = DualMask(iterations=0)
    assert {dm0.phase(loop, r) for r in range(8)} == {"mask"}
    assert not any(dm0.refines_personal_after(loop, r) for r in range(8))
    with pytest.raises(ConfigError, match="DualMask.iterations=-1"):
        DualMask(iterations=-1)
    with pytest.raises(ConfigError, match="DualMask.coverage_threshold=1.5"):
        DualMask(coverage_threshold=1.5)
    # T = 30, 2 iterations: blocks start at round(0), round(7.5) = 8, 15, round(22.5) = 22
    loop30 = tiny_loop(tmp_path, num_rounds=30)
    phases = [dm.phase(loop30, r) for r in range(30)]
    assert phases == ["mask"] * 8 + ["global"] * 7 + ["mask"] * 7 + ["global"] * 8
    assert [r for r in range(30) if dm.refines_personal_after(loop30, r)] == [14, 29]
    # each phase needs at least one round
    too_short = tiny_loop(tmp_path / "short", num_rounds=3, callbacks=[DualMask(iterations=2)])
    with pytest.raises(ConfigError, match="DualMask.iterations=2 is invalid: expected at most 1 for 3 rounds"):
        too_short.fit(tiny_module(), tiny_datamodule())
    with pytest.raises(ConfigError, match="DualMask.global_mask_scope='all'"):
        DualMask(global_mask_scope="all")  # type: ignore[arg-type]


# ---- Phase 2 trains exactly the positions it should ---------------------------------------------------------------
class _Record(FederatedCallback):
    """Placed before DualMask: records every client's θ_c before personal refinement, and every fit."""

    scratch_attributes = ("before", "global_before", "fits")  # test records, read in process only

    def __init__(self) -> None:
        self.before: dict[int, dict[str, torch.Tensor]] = {}
        self.global_before: dict[str, torch.Tensor] = {}
        self.fits: list[ClientUpdate] = []

    def on_after_aggregate(self, loop):  # type: ignore[no-untyped-def]
        self.before = {k: {n: v.clone() for n, v in loop.personal_state(k).items()} for k in range(loop.num_clients)}
        self.global_before = {n: v.clone() for n, v in loop.global_state.items()}

    def on_client_fit_end(self, loop, module, update):  # type: ignore[no-untyped-def]
        self.fits.append(update)


_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize(("accelerator", "precision"), [("cpu", "32-true"), ("cpu", "bf16-mixed"),
                                                        pytest.param("gpu", "16-mixed", marks=_GPU),
                                                        pytest.param("gpu", "bf16-mixed", marks=_GPU)])
def test_phase2_trains_exactly_the_positions_it_should(tmp_path: Path, accelerator: str, precision: str) -> None:
    rec = _Record()
    dm = DualMask(density=0.5, iterations=1, alpha0=0.3)
    # weight decay and momentum would move frozen entries if they were only gradient-masked
    loop = tiny_loop(tmp_path, num_rounds=2, clients_per_round=2, callbacks=[rec, dm], accelerator=accelerator,
                     precision=precision)
    loop.fit(tiny_module(weight_decay=0.05, momentum=0.9), tiny_datamodule())
    assert [dm.phase(loop, r) for r in range(2)] == ["mask", "global"]

    # Alg. 2 (round 1): the sampled clients train w_g ⊙ m_g; uploads are zero outside m_g; w_c does not change
    glob_fits = [u for u in rec.fits if u.round_idx == 1 and u.kind == "train"]
    assert len(glob_fits) == 2
    for u in glob_fits:
        for name, m_g in dm.global_mask.items():
            assert not u.state[name][~m_g].any()
            assert not u.message.tensors[name][~m_g].any()  # type: ignore[union-attr]

    # Alg. 3 (after round 1): every client trains only m_c − m_g; everything else is bit-identical
    refits = [u for u in rec.fits if u.kind == "personal_refine"]
    assert sorted(u.client_idx for u in refits) == [0, 1, 2, 3]
    moved_total = 0
    for u in refits:
        start = rec.before[u.client_idx]
        m_c = dm.masks(loop, u.client_idx)
        for name, v in u.state.items():
            if name in m_c:
                trainable = m_c[name] & ~dm.global_mask[name]
                assert torch.equal(v[~trainable], start[name][~trainable]), name
                moved = (v[trainable] != start[name][trainable]).float().mean().item()
                assert moved > 0.5, (name, moved)
                moved_total += 1
            else:  # shared dense tensors (biases) are frozen
                assert torch.equal(v, start[name]), name
    assert moved_total > 0
    # personal refinement does not touch the server's model
    for name, v in loop.global_state.items():  # type: ignore[union-attr]
        assert torch.equal(v, rec.global_before[name])


def test_phase1_start_and_upload(tmp_path: Path) -> None:
    """Alg. 1 lines 4-6 and 13: the start is w_g on m_g ∩ m_c, w_c on m_c − m_g, zero elsewhere; the upload is the
    trained weights on the readjusted m_c, with m_c."""
    expected: dict[int, dict[str, torch.Tensor]] = {}
    seen: dict[int, dict[str, torch.Tensor]] = {}

    class Start(FederatedCallback):
        def on_round_start(self, loop, round_idx):  # type: ignore[no-untyped-def]
            dm = loop.fed_callbacks[0]
            for k in range(loop.num_clients):
                m_c = dm.masks(loop, k)
                w_c = dm.personal_weights(loop, k, m_c)
                expected[k] = {n: compose_personal(loop.global_state[n], dm.global_mask[n], w_c[n], m)
                               for n, m in m_c.items()}

        def on_client_fit_start(self, loop, module, context):  # type: ignore[no-untyped-def]
            seen[context.client_idx] = {n: p.detach().clone() for n, p in module.named_parameters()}

    rec = _Record()
    dm = DualMask(density=0.5, iterations=0, alpha0=0.3)
    loop = tiny_loop(tmp_path, num_rounds=2, clients_per_round=2, callbacks=[dm, Start(), rec])
    loop.fit(tiny_module(), tiny_datamodule())
    last = [u for u in rec.fits if u.round_idx == 1]
    assert len(last) == 2
    for u in last:
        for name, theta in expected[u.client_idx].items():
            assert torch.equal(seen[u.client_idx][name], theta), name
        new = u.extras.get("next_mask")
        assert new is not None  # alpha0 > 0: readjusted in every Phase 1 round
        for name, m in new.items():
            assert torch.equal(u.message.masks[name], m)  # type: ignore[union-attr]
            assert torch.equal(u.message.tensors[name], u.state[name] * m)  # type: ignore[union-attr]
        # w_c now holds the trained weights on the new mask (regrown positions at zero)
        m_c = dm.masks(loop, u.client_idx)
        w_c = dm.personal_weights(loop, u.client_idx, m_c)
        for name, m in m_c.items():
            assert torch.equal(m, new[name])
            assert torch.equal(w_c[name], u.state[name] * m)


def test_dmpfl_resume_is_identical(tmp_path: Path) -> None:
    """A run cut after round 1 (Phase 1, Phase 2 and one personal refinement done) and resumed equals the full run."""

    def make(d: Path, rounds: int):  # type: ignore[no-untyped-def]
        return tiny_loop(d, num_rounds=rounds, clients_per_round=2,
                         callbacks=[DualMask(density=0.5, iterations=2, alpha0=0.3, total_rounds=4)])

    full = make(tmp_path / "full", 4)
    full.fit(tiny_module(), tiny_datamodule())
    make(tmp_path / "cut", 2).fit(tiny_module(), tiny_datamodule())
    res = make(tmp_path / "cut", 4)
    res.fit(tiny_module(), tiny_datamodule(), ckpt_path=str(tmp_path / "cut/checkpoints/last.ckpt"))
    for k, v in full.global_state.items():  # type: ignore[union-attr]
        assert torch.equal(v, res.global_state[k]), k  # type: ignore[index]
    a, b = full.fed_callbacks[0], res.fed_callbacks[0]
    assert all(torch.equal(a.global_mask[n], b.global_mask[n]) for n in a.global_mask)  # type: ignore[attr-defined]
    for k in range(4):
        pa, pb = full.personal_state(k), res.personal_state(k)
        assert all(torch.equal(pa[n], pb[n]) for n in pa)
    assert [r["acc_mean"] for r in full.history] == [r["acc_mean"] for r in res.history]


def test_feddst_keeps_one_synchronised_sparse_model(tmp_path: Path) -> None:
    dst = FedDST(density=0.5, alpha0=0.2, every_n_rounds=1)
    loop = tiny_loop(tmp_path, num_rounds=3, clients_per_round=2, callbacks=[dst])
    out = loop.fit(tiny_module(), tiny_datamodule())
    glob = loop.global_state
    assert glob is not None
    for k in range(4):  # the personal model is the global sparse model θ_g = w_g ⊙ m_g
        theta = loop.personal_state(k)
        for name, m in dst.global_mask.items():
            assert torch.equal(theta[name], glob[name] * m)
    assert out["final"]["acc_mean"] == pytest.approx(out["final"]["global_acc"])
    dens = sum(int(m.sum()) for m in dst.global_mask.values()) / sum(m.numel() for m in dst.global_mask.values())
    assert 0.3 < dens <= 0.5 + 1e-6


class _Grab(FederatedCallback):
    scratch_attributes = ("fits",)  # test records, read in process only

    def __init__(self) -> None:
        self.fits: list[ClientUpdate] = []

    def on_client_fit_end(self, loop, module, update):  # type: ignore[no-untyped-def]
        self.fits.append(update)


def test_ditto_personal_models_are_pulled_towards_the_global_one(tmp_path: Path) -> None:
    def dist(lam: float) -> float:
        loop = tiny_loop(tmp_path / str(lam), num_rounds=2, callbacks=[Ditto(lam=lam)])
        loop.fit(tiny_module(), tiny_datamodule())
        glob = loop.global_state
        assert glob is not None
        return sum(float((loop.personal_state(k)[n] - glob[n]).norm()) for k in range(4) for n in glob
                   if glob[n].is_floating_point())

    free, pulled = dist(0.0), dist(5.0)
    assert pulled < 0.7 * free
    grab = _Grab()
    loop = tiny_loop(tmp_path / "g", num_rounds=1, clients_per_round=2, callbacks=[Ditto(lam=0.1), grab])
    loop.fit(tiny_module(), tiny_datamodule())
    kinds = sorted(u.kind for u in grab.fits)
    assert kinds == ["personal", "personal", "train", "train"]  # one global and one personal fit per participant
    with pytest.raises(ConfigError, match="Ditto.lam=-1"):
        Ditto(lam=-1)
