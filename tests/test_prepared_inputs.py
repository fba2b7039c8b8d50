"""Prepared inputs (``data.cache_inputs``): the whole dataset's model inputs made once where the data lives, so that a
batch is one gather. The batches must be the very values the per-batch path makes (every loader, every mode, every
epoch), the count of operations per batch must be what the page says, and bad input is refused in one line."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import count_operators, fit_rows, metric_rows

from pl_fedsparse.data import FederatedDataModule
from pl_fedsparse.data.loaders import AUGMENT_PAD, PreparedInputs, TensorBatchLoader, prepare_inputs
from pl_fedsparse.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
MEAN, STD = [0.5, 0.4, 0.3], [0.2, 0.25, 0.3]


def _images(n: int = 150, side: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (n, 3, side, side), dtype=torch.uint8, generator=g), torch.arange(n) % 7


def _same_batches(a: Any, b: Any) -> int:
    """Asserts two loaders give equal batches (values, dtype, shape and layout); returns how many."""
    got_a, got_b = list(a), list(b)
    assert len(got_a) == len(got_b)
    for (xa, ya), (xb, yb) in zip(got_a, got_b):
        assert xa.dtype == xb.dtype and xa.shape == xb.shape and xa.stride() == xb.stride()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    return len(got_a)


@pytest.mark.parametrize("augment", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
def test_a_loader_with_prepared_inputs_gives_the_same_batches(augment: bool, drop_last: bool) -> None:
    """Shuffled, with and without augmentation, a client's rows of a shared base, the last partial batch kept or
    dropped, three epochs, and an epoch rewound with ``set_epoch``."""
    images, labels = _images()
    rows = torch.randperm(150, generator=torch.Generator().manual_seed(1))[:97]
    prepared = prepare_inputs(images, MEAN, STD, pad=AUGMENT_PAD if augment else 0, chunk=40)
    kw: dict[str, Any] = dict(shuffle=True, generator_seed=5, mean=MEAN, std=STD, augment=augment,
                              drop_last=drop_last, indices=rows)
    plain = TensorBatchLoader(images, labels, 16, **kw)
    fast = TensorBatchLoader(images, labels, 16, prepared=prepared, **kw)
    for _ in range(3):
        assert _same_batches(plain, fast) == (6 if drop_last else 7)
    plain.set_epoch(1)
    fast.set_epoch(1)
    _same_batches(plain, fast)


def test_prepared_features_give_the_same_batches() -> None:
    """Float features normalised by ``mean``/``std`` (one value per entry of dimension 1)."""
    x = torch.randn(60, 4, 5, generator=torch.Generator().manual_seed(2))
    y = torch.arange(60) % 3
    mean, std = [0.1, -0.2, 0.3, 0.0], [1.5, 0.5, 2.0, 1.0]
    kw: dict[str, Any] = dict(shuffle=True, generator_seed=1, mean=mean, std=std)
    _same_batches(TensorBatchLoader(x, y, 8, **kw),
                  TensorBatchLoader(x, y, 8, prepared=prepare_inputs(x, mean, std, chunk=7), **kw))


@pytest.mark.parametrize("augment", [False, True])
@pytest.mark.parametrize("test_mode", ["split", "global", "pooled"])
def test_the_datamodules_loaders_are_the_same_with_cached_inputs(augment: bool, test_mode: str) -> None:
    """``data.cache_inputs: true`` against ``false``: every client's training batches and evaluation batches (every
    split, with and without a shifted test set, and a generated corruption, which has no cache) are equal."""
    kw: dict[str, Any] = dict(name="synthetic", num_clients=3, augment=augment, test_mode=test_mode,
                              synthetic={"num_train": 600, "num_test": 120, "size": 8})
    off = FederatedDataModule(cache_inputs=False, **kw)
    on = FederatedDataModule(cache_inputs=True, **kw)
    off.setup()
    on.setup()
    for k in range(3):
        assert on.train_loader(k, seed=4).prepared is not None
        assert _same_batches(off.train_loader(k, seed=4), on.train_loader(k, seed=4)) > 1
        for split in ("train", "test"):
            for shift in (0.0, 0.5):
                _same_batches(off.eval_loader(k, split, shift=shift), on.eval_loader(k, split, shift=shift))
        _same_batches(off.eval_loader(k, "test", corruption="gaussian_noise", severity=2),
                      on.eval_loader(k, "test", corruption="gaussian_noise", severity=2))
    made = on._prepared
    assert made is not None and set(made) == ({"train", "test"} if test_mode == "global" else {"train"})
    assert made["train"].pad == (AUGMENT_PAD if augment else 0)


def test_auto_makes_no_prepared_inputs_on_the_host_and_a_pickled_copy_makes_its_own() -> None:
    """``auto`` on the host: nothing made (4 bytes per input value); a pickled datamodule does not carry them (up to
    6 times the dataset) and makes them again, where its copy of the data is, on its first loader."""
    kw: dict[str, Any] = dict(name="synthetic", num_clients=2, synthetic={"num_train": 200, "num_test": 40, "size": 8})
    auto = FederatedDataModule(**kw)
    auto.setup()
    assert auto.cache_inputs == "auto" and auto.train_loader(0, seed=0).prepared is None
    on = FederatedDataModule(cache_inputs=True, **kw)
    on.setup()
    assert on.train_loader(0, seed=0).prepared is not None
    copy = pickle.loads(pickle.dumps(on))
    assert copy._prepared is None
    assert copy.train_loader(0, seed=0).prepared is not None
    _same_batches(on.train_loader(1, seed=2), copy.train_loader(1, seed=2))


def _device_operators(fn: Any, monkeypatch: pytest.MonkeyPatch) -> int:
    """Operators ``fn()`` dispatches that launch a kernel on a GPU (views and allocations left out), not counting
    the augmentation's draws: those are made on the host from the epoch's CPU generator (then moved in one copy)."""
    drawing = [False]
    draws = TensorBatchLoader._epoch_draws

    def host_draws(self: Any, *a: Any, **k: Any) -> Any:
        drawing[0] = True
        try:
            return draws(self, *a, **k)
        finally:
            drawing[0] = False

    monkeypatch.setattr(TensorBatchLoader, "_epoch_draws", host_draws)
    n = count_operators(fn, skip=lambda: drawing[0])
    monkeypatch.undo()
    return n


@pytest.mark.parametrize("augment", [False, True])
def test_a_prepared_batch_is_two_operators(augment: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """With prepared inputs a batch costs two operators on the data's device, its inputs' gather and its labels'
    (one more batch, two more; the epoch's crop arithmetic is three, once); without them five, and fifteen with the
    augmentation's padding, index arithmetic and crop. Fails when an operator per batch comes back."""
    images, labels = _images(256)
    prepared = prepare_inputs(images, MEAN, STD, pad=AUGMENT_PAD if augment else 0)

    def epoch(batches: int, cached: bool) -> int:
        loader = TensorBatchLoader(images, labels, 256 // batches, shuffle=True, generator_seed=0, mean=MEAN,
                                   std=STD, augment=augment, prepared=prepared if cached else None)
        return _device_operators(lambda: list(loader), monkeypatch)

    epoch(4, True)  # (the crop's constant index tensors are made once per process)
    per_batch = (epoch(8, True) - epoch(4, True)) / 4
    assert per_batch == 2, per_batch
    assert (epoch(8, False) - epoch(4, False)) / 4 == (15 if augment else 5)


def test_bad_prepared_inputs_and_cache_settings_are_refused_in_one_line() -> None:
    images, labels = _images()
    with pytest.raises(ConfigError, match=r"^prepared=\(149, 3, 12, 12\) is invalid: expected None or the "
                                          r"PreparedInputs of these 150 inputs"):
        TensorBatchLoader(images, labels, 8, False, 0, MEAN, STD, prepared=prepare_inputs(images[:149], MEAN, STD))
    with pytest.raises(ConfigError, match=r"^prepared.pad=0 is invalid: expected 4 for an augmenting loader"):
        TensorBatchLoader(images, labels, 8, False, 0, MEAN, STD, augment=True,
                          prepared=prepare_inputs(images, MEAN, STD))
    with pytest.raises(ConfigError, match=r"^prepared=.* is invalid"):
        TensorBatchLoader(images, labels, 8, False, 0, MEAN, STD, prepared="all of it")  # type: ignore[arg-type]
    tokens = torch.randint(0, 50, (20, 6))
    with pytest.raises(ConfigError, match=r"^prepared=\(20, 6\) is invalid: expected None for token ids"):
        TensorBatchLoader(tokens, torch.zeros(20), 4, False, 0, prepared=PreparedInputs(tokens.clone()))
    with pytest.raises(ConfigError, match=r"^pad=2 is invalid: expected 0 for features inputs"):
        prepare_inputs(torch.randn(5, 3), pad=2)
    for bad in ("yes", 1, None):
        with pytest.raises(ConfigError, match=r"^data.cache_inputs=.* is invalid: expected auto, true or false"):
            FederatedDataModule(name="synthetic", num_clients=2, cache_inputs=bad)  # type: ignore[arg-type]


@pytest.mark.slow
def test_a_run_with_cached_inputs_has_the_same_numbers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A whole federation (FedSpa's masks, augmentation) with ``--data.cache_inputs true`` on the host: every
    recorded number equal to the run without."""
    rows = {}
    for cached in ("false", "true"):
        run = tmp_path / cached
        fit_rows(["--config", str(REPO / "configs/synthetic_fedspa.yaml"), "--trainer.num_rounds", "3",
                  "--trainer.eval_every", "3", "--data.augment", "true", "--data.cache_inputs", cached,
                  "--trainer.default_root_dir", str(run), "--trainer.enable_progress_bar", "false"], capsys)
        rows[cached] = metric_rows(run)
    assert rows["true"] == rows["false"] and len(rows["true"]) == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_auto_prepares_the_inputs_on_the_gpu_with_the_same_batches() -> None:
    """``data.device: auto`` and ``data.cache_inputs: auto`` on a GPU: the inputs are prepared there, and every batch
    equals the uncached path's on the same device."""
    kw: dict[str, Any] = dict(name="synthetic", num_clients=3, augment=True,
                              synthetic={"num_train": 600, "num_test": 120, "size": 8})
    on, off = FederatedDataModule(**kw), FederatedDataModule(cache_inputs=False, **kw)
    for dm in (on, off):
        dm.setup()
        assert dm.place_data("cuda")
    assert on.train_loader(0, seed=1).prepared is not None
    assert on.train_loader(0, seed=1).prepared.values.device.type == "cuda"  # type: ignore[union-attr]
    for k in range(3):
        _same_batches(off.train_loader(k, seed=1), on.train_loader(k, seed=1))
        _same_batches(off.eval_loader(k, "test"), on.eval_loader(k, "test"))
