"""The module protocol (``pl_fedsparse.protocol``): any LightningModule runs, a broken one is refused in one line, and
what the loop measures for a module without the optional methods equals what ``FederatedModule`` reports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conftest import tiny_datamodule, tiny_loop, tiny_module
from torch import nn
from torch.nn import functional as F

from pl_fedsparse import ConfigError, current_fit
from pl_fedsparse.callbacks import FineTune, GradientRegrow
from pl_fedsparse.executors import FitMeter
from pl_fedsparse.models import MLP


class Plain(pl.LightningModule):
    """FederatedModule's behaviour (MLP backbone, plain SGD, cross-entropy) without subclassing it."""

    def __init__(self, lr: float = 0.1, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.backbone = MLP(num_classes=4, in_channels=1, input_size=8, hidden=[16])
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _history(tmp_path: Path, module: Any, **kw: Any) -> list[dict[str, Any]]:
    loop = tiny_loop(tmp_path, **kw)
    loop.fit(module, tiny_datamodule())
    return [{k: v for k, v in r.items() if not k.startswith("time")} for r in loop.history]


@pytest.mark.slow
def test_a_plain_lightning_module_gives_federated_modules_numbers(tmp_path: Path) -> None:
    """Same weights, optimiser and loss: the same run — the loss and samples the loop measures itself (FitMeter)
    equal FederatedModule's own fit_metrics, and GradientRegrow's gradients (cross-entropy without `loss`) too."""
    for i, make in enumerate((lambda: [FineTune(epochs=1)], lambda: [GradientRegrow(density=0.5)])):
        ours = _history(tmp_path / f"ours{i}", tiny_module(seed=0, lr=0.1), callbacks=make())
        plain = _history(tmp_path / f"plain{i}", Plain(lr=0.1, seed=0), callbacks=make())
        assert [r["train_loss"] for r in plain] == pytest.approx([r["train_loss"] for r in ours], rel=1e-6)
        for a, b in zip(plain, ours):
            assert a["acc_mean"] == pytest.approx(b["acc_mean"], abs=1e-9)
            assert a["flops_train"] == b["flops_train"] and a["comm_bytes_total"] == b["comm_bytes_total"]


def test_the_optional_loss_is_used_for_gradients_outside_a_fit(tmp_path: Path) -> None:
    calls = []

    class WithLoss(Plain):
        def loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            calls.append(len(y))
            return F.cross_entropy(logits, y)

    _history(tmp_path, WithLoss(), callbacks=[GradientRegrow(density=0.5)])
    assert calls  # GradientRegrow's regrowth gradients came from the module's loss


def test_learning_rate_by_round_through_the_fit_context(tmp_path: Path) -> None:
    seen: list[tuple[int, float]] = []

    class Decaying(Plain):
        def configure_optimizers(self) -> Any:
            fit = current_fit()
            assert fit is not None
            lr = self.lr * 0.5 ** fit.lr_round
            seen.append((fit.round_idx, lr))
            return torch.optim.SGD(self.parameters(), lr=lr)

    _history(tmp_path, Decaying(), num_rounds=3)
    assert {r: lr for r, lr in seen} == {0: 0.1, 1: 0.05, 2: 0.025}


class NoStep(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.flatten(1))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class NoOptimizer(NoStep):
    configure_optimizers = pl.LightningModule.configure_optimizers  # type: ignore[assignment]

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return F.cross_entropy(self(batch[0]), batch[1])


class WrongWidth(NoOptimizer):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(64, 7)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Features(WrongWidth):
    def forward(self, x: torch.Tensor) -> Any:
        return {"logits": self.net(x.flatten(1))}


class WrongInput(WrongWidth):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(10, 4)


@pytest.mark.parametrize("module, match", [
    (NoStep(), r"^model=NoStep is invalid: expected a LightningModule that defines training_step"),
    (NoOptimizer(), r"^model=NoOptimizer is invalid: expected a LightningModule that defines configure_optimizers"),
    (WrongWidth(), r"^model=WrongWidth: its logits' width=7 is invalid: expected 4 \(the number of classes of "
                   r"data.name='synthetic'"),
    (Features(), r"^model=Features is invalid: expected forward\(x\) to return a float tensor of logits \[batch, "
                 r"4\], got dict"),
    (WrongInput(), r"^model=WrongInput is invalid: expected a network accepting inputs of shape \(1, 8, 8\)"),
    (nn.Linear(64, 4), r"^model=Linear is invalid: expected a lightning.pytorch.LightningModule"),
])
def test_a_module_breaking_the_protocol_is_refused_before_anything_is_written(tmp_path: Path, module: Any,
                                                                              match: str) -> None:
    loop = tiny_loop(tmp_path / "run")
    with pytest.raises(ConfigError, match=match) as e:
        loop.fit(module, tiny_datamodule())
    assert "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()


def test_a_datamodule_of_another_kind_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^data=LightningDataModule is invalid: expected a "
                                          r"pl_fedsparse.data.FederatedDataModule"):
        tiny_loop(tmp_path).fit(Plain(), pl.LightningDataModule())


@pytest.mark.parametrize("batch, n", [
    ((torch.zeros(5, 3), torch.zeros(5)), 5),
    ([torch.zeros(4, 2), torch.zeros(4, 2), torch.zeros(4)], 4),
    ({"x": torch.zeros(6, 2), "y": torch.zeros(6)}, 6),
    ({"input_ids": torch.zeros(3, 9), "labels": torch.zeros(3)}, 3),
    (torch.zeros(7, 2), 7),
])
def test_fit_meter_counts_the_samples_of_a_batch(batch: Any, n: int) -> None:
    assert FitMeter.batch_size(batch) == n


def test_fit_meter_is_the_sample_weighted_mean_loss() -> None:
    meter = FitMeter()
    for loss, n in ((1.0, 4), (4.0, 2)):
        meter.on_train_batch_end(None, None, torch.tensor(loss), (torch.zeros(n, 1), torch.zeros(n)), 0)  # type: ignore[arg-type]
    assert meter.metrics() == {"train_loss": pytest.approx((4 + 8) / 6), "samples_seen": 6.0}
    meter.on_train_batch_end(None, None, {"loss": torch.tensor(0.0)}, (torch.zeros(6, 1), torch.zeros(6)), 0)  # type: ignore[arg-type]
    assert meter.metrics()["train_loss"] == pytest.approx(1.0)
