"""Shared fixtures: a tiny synthetic federation that trains in well under a second per round."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from pl_fedsparse import FederatedLoop, FederatedModule
from pl_fedsparse.data import FederatedDataModule
from pl_fedsparse.models import MLP

TINY_SYNTH = {"num_train": 400, "num_test": 100, "size": 8, "channels": 1, "num_classes": 4}


def tiny_datamodule(**kw: Any) -> FederatedDataModule:
    args: dict[str, Any] = dict(name="synthetic", num_clients=4, alpha=0.5, batch_size=16, synthetic=TINY_SYNTH)
    args.update(kw)
    return FederatedDataModule(**args)


def tiny_module(seed: int = 0, **kw: Any) -> FederatedModule:
    import torch

    torch.manual_seed(seed)
    backbone = MLP(num_classes=4, in_channels=1, input_size=8, hidden=[16])
    return FederatedModule(backbone, lr=kw.pop("lr", 0.1), **kw)


def tiny_loop(tmp_path: Any, **kw: Any) -> FederatedLoop:
    args: dict[str, Any] = dict(num_rounds=2, accelerator="cpu", default_root_dir=str(tmp_path), logger=False,
                                enable_progress_bar=False)
    args.update(kw)
    return FederatedLoop(**args)


# the CLI tests' expected argv for the tiny task
TINY_CLI = [
    "--seed_everything", "0",
    "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false",
    "--model.backbone", "pl_fedsparse.models.MLP", "--model.backbone.init_args.num_classes", "4",
    "--model.backbone.init_args.in_channels", "1", "--model.backbone.init_args.input_size", "8",
    "--data.name", "synthetic", "--data.num_clients", "4", "--data.batch_size", "16",
    "--data.synthetic", '{"num_train": 400, "num_test": 100, "size": 8, "channels": 1, "num_classes": 4}',
]


@pytest.fixture(autouse=True)
def _quiet_logs() -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
