"""Test-time shift: x % shift, corruptions, evaluation views, ShiftEvaluation and AdaptiveInference (Alg. 4)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_datamodule, tiny_loop, tiny_module

from pl_fedsparse import ConfigError
from pl_fedsparse.callbacks import AdaptiveInference, DualMask, FineTune, LocalTraining, ShiftEvaluation
from pl_fedsparse.data.corruptions import CORRUPTIONS, corrupt
from pl_fedsparse.data.loaders import normalize
from pl_fedsparse.evaluation import EvalView
from pl_fedsparse.functional.inference import adaptive_choice, entropy, output_cosine


# ---- x % shift --------------------------------------------------------------------------------------------------
def _rows(x: torch.Tensor) -> set[bytes]:
    return {r.numpy().tobytes() for r in x.flatten(1)}


@pytest.mark.parametrize("shift", [0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
def test_shift_replaces_exactly_x_percent_with_global_test_samples(shift: float) -> None:
    dm = tiny_datamodule(test_mode="split", split_ratios=[0.5, 0.0, 0.5])
    dm.setup()
    base = dm.base
    pool = _rows(normalize(base.test_x, base.mean, base.std))
    for k in range(dm.num_clients):
        own_idx = dm.client_indices(k, "test")
        own = normalize(base.train_x[torch.as_tensor(own_idx)], base.mean, base.std)
        own_rows = [r.numpy().tobytes() for r in own.flatten(1)]
        xs = torch.cat([x for x, _ in dm.eval_loader(k, "test", shift=shift, seed=3)])
        n = len(own_idx)
        assert len(xs) == n  # same size as the client's own test set
        rows = [r.numpy().tobytes() for r in xs.flatten(1)]
        from_pool = sum(r in pool and r not in set(own_rows) for r in rows)
        kept = sum(r in set(own_rows) for r in rows)
        assert from_pool == round(shift * n)
        assert kept == n - round(shift * n)
        # the kept ones are distinct own samples
        assert len({r for r in rows if r in set(own_rows)}) == kept
    # the same seed gives the same shifted set; another seed another one
    a = torch.cat([x for x, _ in dm.eval_loader(0, "test", shift=shift, seed=3)])
    b = torch.cat([x for x, _ in dm.eval_loader(0, "test", shift=shift, seed=3)])
    assert torch.equal(a, b)


def test_shift_in_global_test_mode_and_bad_values() -> None:
    dm = tiny_datamodule(test_mode="global", test_per_client=20)
    dm.setup()
    xs = torch.cat([x for x, _ in dm.eval_loader(1, "test", shift=0.5, seed=0)])
    assert len(xs) == dm.num_samples(1, "test")
    with pytest.raises(ConfigError, match="shift=1.5"):
        dm.eval_loader(0, "test", shift=1.5)


# ---- corruptions ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", CORRUPTIONS)
def test_each_corruption_is_deterministic_and_changes_the_images(name: str) -> None:
    gen = torch.Generator().manual_seed(0)
    # smooth images with texture: every corruption (blur, pixelate, jpeg, ...) has something to change
    yy, xx = torch.meshgrid(torch.arange(32.0), torch.arange(32.0), indexing="ij")
    base = (127 + 60 * torch.sin(xx / 3) * torch.cos(yy / 4))[None, None].expand(4, 3, 32, 32)
    imgs = (base + torch.randint(-40, 40, (4, 3, 32, 32), generator=gen)).clamp(0, 255).to(torch.uint8)
    prev = None
    for severity in range(1, 6):
        a = corrupt(imgs, name, severity, torch.Generator().manual_seed(7))
        b = corrupt(imgs, name, severity, torch.Generator().manual_seed(7))
        assert a.dtype == torch.uint8 and a.shape == imgs.shape
        assert torch.equal(a, b), (name, severity)  # deterministic for a seed
        assert not torch.equal(a, imgs), (name, severity)  # changes the images
        if prev is not None:
            assert not torch.equal(a, prev), (name, severity)  # severities differ
        prev = a


def test_corruption_errors_and_severity_order() -> None:
    x = torch.full((2, 3, 8, 8), 100, dtype=torch.uint8)
    with pytest.raises(ConfigError, match="corruption='fog'"):
        corrupt(x, "fog", 1)
    with pytest.raises(ConfigError, match="severity=6"):
        corrupt(x, "contrast", 6)
    with pytest.raises(ConfigError, match="images="):
        corrupt(x.float(), "contrast", 1)  # type: ignore[arg-type]
    # noise grows with the severity
    img = torch.full((8, 3, 16, 16), 128, dtype=torch.uint8)
    errs = [float((corrupt(img, "gaussian_noise", s, torch.Generator().manual_seed(0)).float() - 128).abs().mean())
            for s in range(1, 6)]
    assert errs == sorted(errs)


def test_corrupted_eval_loader_is_seeded_per_client() -> None:
    dm = tiny_datamodule(test_mode="split", split_ratios=[0.5, 0.0, 0.5])
    clean = torch.cat([x for x, _ in dm.eval_loader(0, "test", seed=1)])
    a = torch.cat([x for x, _ in dm.eval_loader(0, "test", seed=1, corruption="shot_noise", severity=3)])
    b = torch.cat([x for x, _ in dm.eval_loader(0, "test", seed=1, corruption="shot_noise", severity=3)])
    assert torch.equal(a, b) and not torch.equal(a, clean) and a.shape == clean.shape


# ---- adaptive inference (Alg. 4) ----------------------------------------------------------------------------------
def test_adaptive_choice_follows_alg4_on_hand_made_logits() -> None:
    c = torch.tensor([[4.0, 0.0, 0.0], [0.2, 0.1, 0.0], [2.0, 0.0, 0.0], [2.0, 0.0, 0.0]])
    g = torch.tensor([[0.5, 0.5, 0.0], [0.0, 3.0, 0.0], [2.0, 0.0, 0.0], [0.0, 2.0, 0.0]])
    be_c, be_g = 0.2, 0.9
    e_c, e_g, sim = entropy(c), entropy(g), output_cosine(c, g)
    expected = (e_c - (1 - sim) * be_c < e_g - (1 - sim) * be_g).tolist()
    got = adaptive_choice(c, g, be_c, be_g).tolist()
    assert got == expected
    # by hand: row 0 personal is confident → θ_c; row 1 personal is unsure, global confident → θ_g;
    # row 2 identical outputs (Sim = 1): the entropies decide, equal → not "<" → θ_g;
    # row 3 equally confident but disagreeing (Sim < 1): the higher base entropy of θ_g is subtracted → θ_g
    assert got == [True, False, False, False]
    # a large base entropy of the personal model flips row 3 to θ_c
    assert adaptive_choice(c[3:], g[3:], base_c=5.0, base_g=0.0).tolist() == [True]
    # entropy by hand: uniform over 3 classes
    assert entropy(torch.zeros(1, 3)).item() == pytest.approx(float(torch.log(torch.tensor(3.0))))


# ---- in the loop ----------------------------------------------------------------------------------------------------
def _metrics(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_shift_evaluation_reports_every_kind_per_view(tmp_path: Path) -> None:
    cbs = [FineTune(epochs=1), ShiftEvaluation(shifts=[0.0, 0.5, 1.0], corruptions=["contrast"], severities=[2])]
    loop = tiny_loop(tmp_path, num_rounds=2, callbacks=cbs)
    loop.fit(tiny_module(), tiny_datamodule(test_mode="split", split_ratios=[0.5, 0.0, 0.5]))
    rows = _metrics(tmp_path)
    first, last = rows[0], rows[-1]
    assert "shift50/acc_mean" not in first  # when="last"
    for view in ("shift50", "shift100", "contrast_s2"):
        for key in ("acc_mean", "acc_bottom10", "global_acc"):
            assert 0.0 <= last[f"{view}/{key}"] <= 1.0
    avg = (last["acc_mean"] + last["shift50/acc_mean"] + last["shift100/acc_mean"]) / 3
    assert last["shift_avg/acc_mean"] == pytest.approx(avg)
    assert last["corruption_avg/global_acc"] == pytest.approx(last["contrast_s2/global_acc"])
    with pytest.raises(ConfigError, match="ShiftEvaluation.corruptions='smog'"):
        ShiftEvaluation(corruptions=["smog"])
    with pytest.raises(ConfigError, match="ShiftEvaluation.shifts=2"):
        ShiftEvaluation(shifts=[2])


def test_shift0_view_equals_the_clean_evaluation(tmp_path: Path) -> None:
    loop = tiny_loop(tmp_path, num_rounds=1, callbacks=[LocalTraining()])
    loop.fit(tiny_module(), tiny_datamodule())
    logits, _ = loop.predict(0, "test")
    logits0, _ = loop.predict(0, "test", shift=0.0)
    assert torch.equal(logits, logits0)
    with pytest.raises(ConfigError, match="EvalView.shift=2"):
        EvalView("x", shift=2)


def test_adaptive_inference_in_a_federation(tmp_path: Path) -> None:
    ai = AdaptiveInference()
    cbs = [DualMask(density=0.5, iterations=1), ai, ShiftEvaluation(shifts=[0.0, 1.0])]
    loop = tiny_loop(tmp_path / "a", num_rounds=2, callbacks=cbs)
    loop.fit(tiny_module(), tiny_datamodule(test_mode="split", split_ratios=[0.5, 0.0, 0.5]))
    last = _metrics(tmp_path / "a")[-1]
    for view in ("", "shift100/"):
        frac = last[f"{view}adaptive_chose_personal"]
        assert 0.0 <= frac <= 1.0
        assert 0.0 <= last[f"{view}adaptive_acc"] <= 1.0
    assert set(ai.base_entropies) == {0, 1, 2, 3}
    # as_personal: the adaptive prediction becomes acc_mean, θ_c alone is personal_only_acc
    cbs2 = [DualMask(density=0.5, iterations=1), AdaptiveInference(as_personal=True), ShiftEvaluation(shifts=[0.0])]
    loop2 = tiny_loop(tmp_path / "b", num_rounds=2, callbacks=cbs2)
    loop2.fit(tiny_module(), tiny_datamodule(test_mode="split", split_ratios=[0.5, 0.0, 0.5]))
    last2 = _metrics(tmp_path / "b")[-1]
    assert last2["acc_mean"] == pytest.approx(last["adaptive_acc"])
    assert last2["personal_only_acc"] == pytest.approx(last["acc_mean"])
    # a method without a global model is a configuration error
    loop3 = tiny_loop(tmp_path / "c", num_rounds=1, callbacks=[LocalTraining(), AdaptiveInference()])
    with pytest.raises(ConfigError, match="AdaptiveInference needs a global model"):
        loop3.fit(tiny_module(), tiny_datamodule())
    loop4 = tiny_loop(tmp_path / "d", num_rounds=1, eval_global=False, callbacks=[AdaptiveInference()])
    with pytest.raises(ConfigError, match="AdaptiveInference needs a global model"):
        loop4.fit(tiny_module(), tiny_datamodule())
    assert not (tmp_path / "d" / "checkpoints").exists()  # refused before any round was trained


def test_adaptive_predictions_pick_rows_of_the_chosen_model(tmp_path: Path) -> None:
    ai = AdaptiveInference()
    outputs = {"adaptive_base": {"personal": torch.tensor([[3.0, 0.0]]), "global": torch.tensor([[0.5, 0.0]])},
               "clean": {"personal": torch.tensor([[4.0, 0.0], [0.1, 0.0]]),
                         "global": torch.tensor([[0.0, 0.3], [0.0, 4.0]])}}
    ai.on_client_predictions(None, 0, outputs, {})  # type: ignore[arg-type]
    choose = adaptive_choice(outputs["clean"]["personal"], outputs["clean"]["global"], *ai.base_entropies[0])
    assert choose.tolist() == [True, False]
    assert torch.equal(outputs["clean"]["adaptive"], torch.tensor([[4.0, 0.0], [0.0, 4.0]]))
