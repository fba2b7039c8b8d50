"""Shared fixtures: a tiny synthetic federation that trains in well under a second per round."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from pl_fedsparse import FederatedCallback, FederatedLoop, FederatedModule
from pl_fedsparse.callbacks import (
    Ditto,
    DualMask,
    FedSpaAggregation,
    FineTune,
    Gossip,
    GradientRegrow,
    KeepOptimizerState,
    PFedGate,
    RandomRegrow,
    SparseMask,
)
from pl_fedsparse.data import FederatedDataModule
from pl_fedsparse.models import MLP
from pl_fedsparse.topology import Ring

#: one representative callback set per kind of method (server / gossip / server-side per-client messages / private
#: state), as ``(make callbacks, topology class or None)``: what executor and storage parity tests run
METHODS: dict[str, tuple[Any, Any]] = {
    "fedavg_ft": (lambda: [FineTune(epochs=1)], None),
    "fedspa": (lambda: [GradientRegrow(density=0.5), FedSpaAggregation()], None),
    "dispfl": (lambda: [RandomRegrow(density=0.5, same_mask=False, mask_personal_eval=False), Gossip()], Ring),
    "dmpfl": (lambda: [DualMask(density=0.5, iterations=1)], None),
    "ditto_masked": (lambda: [SparseMask(density=0.5), Ditto(lam=0.1)], None),
    "pfedgate": (lambda: [PFedGate(density=0.5, aggregation="index"), KeepOptimizerState()], None),
}

TINY_SYNTH = {"num_train": 400, "num_test": 100, "size": 8, "channels": 1, "num_classes": 4}


def count_operators(fn: Any, skip: Any = None) -> int:
    """The operators ``fn()`` dispatches that would launch a kernel on a GPU (views and allocations left out; and
    those dispatched while ``skip()`` is true). What the tests that hold an operator count use."""
    from torch.utils._python_dispatch import TorchDispatchMode

    count = 0

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            nonlocal count
            if not (func.is_view or func.overloadpacket.__name__ in ("empty", "empty_like", "empty_strided")
                    or (skip is not None and skip())):
                count += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return count


def tiny_datamodule(**kw: Any) -> FederatedDataModule:
    args: dict[str, Any] = dict(name="synthetic", num_clients=4, alpha=0.5, batch_size=16, synthetic=TINY_SYNTH)
    args.update(kw)
    return FederatedDataModule(**args)


def tiny_module(seed: int = 0, **kw: Any) -> FederatedModule:
    import torch

    torch.manual_seed(seed)
    backbone = MLP(num_classes=4, in_channels=1, input_size=8, hidden=[16])
    return FederatedModule(backbone, lr=kw.pop("lr", 0.1), **kw)


def plain_masked_epoch(start: dict[str, Any], mask: dict[str, Any], loader: Any, seed: int, lr: float
                       ) -> dict[str, Any]:
    """One local epoch of plain SGD on :func:`tiny_module` from ``start`` (no library kernel): masked tensors follow
    FedSpa's Eq. 3 (gradient times the mask, weights kept on the mask); ``mask`` may be empty (dense). What the
    plain re-implementations of the method tests train with."""
    import torch
    import torch.nn.functional as F

    module = tiny_module()
    module.load_state_dict(start)
    opt = torch.optim.SGD(module.parameters(), lr=lr)
    named = dict(module.named_parameters())
    torch.manual_seed(seed)
    for x, y in loader:
        opt.zero_grad()
        F.cross_entropy(module(x), y).backward()
        with torch.no_grad():
            for n, m in mask.items():
                named[n].grad.mul_(m)
        opt.step()
        with torch.no_grad():
            for n, m in mask.items():
                named[n].mul_(m)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def plain_dense_gradient(weights: dict[str, Any], loader: Any) -> dict[str, Any]:
    """The dense gradient of one batch of ``loader`` at ``weights`` (the regrowth score of FedSpa's Alg. 2 and
    DisPFL's, before |.|), on :func:`tiny_module`."""
    import torch.nn.functional as F

    module = tiny_module()
    module.load_state_dict(weights)
    module.train()
    x, y = next(iter(loader))
    F.cross_entropy(module(x), y).backward()
    return {n: p.grad.detach().clone() for n, p in module.named_parameters()}


class InFitProbe(FederatedCallback):
    """A callback with a Lightning in-fit hook (it counts the batches of the fits) and no vectorised form: what the
    VectorizedExecutor refuses, or runs in process."""

    scratch_attributes = ("batches",)  # (per-fit scratch: the fit contract)

    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.batches += 1


def tiny_loop(tmp_path: Any, **kw: Any) -> FederatedLoop:
    args: dict[str, Any] = dict(num_rounds=2, accelerator="cpu", default_root_dir=str(tmp_path), logger=False,
                                enable_progress_bar=False)
    args.update(kw)
    return FederatedLoop(**args)


def fit_until_interrupted(loop: FederatedLoop, round_idx: int, module: Any, datamodule: Any) -> None:
    """``loop.fit`` stopped by Ctrl-C just before round ``round_idx`` (its checkpoint then holds ``round_idx``
    finished rounds): what the resume tests resume from."""
    real_round = loop.run_round

    def stop(r: int) -> Any:
        if r == round_idx:
            raise KeyboardInterrupt
        return real_round(r)

    loop.run_round = stop  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        loop.fit(module, datamodule)


# the CLI tests' expected argv for the tiny task
TINY_CLI = [
    "--seed_everything", "0",
    "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false",
    "--model.backbone", "pl_fedsparse.models.MLP", "--model.backbone.init_args.num_classes", "4",
    "--model.backbone.init_args.in_channels", "1", "--model.backbone.init_args.input_size", "8",
    "--data.name", "synthetic", "--data.num_clients", "4", "--data.batch_size", "16",
    "--data.synthetic", '{"num_train": 400, "num_test": 100, "size": 8, "channels": 1, "num_classes": 4}',
]


def callback_config(config: str, callback: str, directory: Any, **init_args: Any) -> str:
    """A copy of ``configs/<config>`` in ``directory`` with ``init_args`` set on the callback whose class path ends
    in ``callback``; returns its path (a list entry cannot be set from the command line)."""
    from pathlib import Path

    import yaml

    cfg = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / config).read_text())
    entry = next(c for c in cfg["trainer"]["callbacks"] if c["class_path"].endswith(callback))
    entry.setdefault("init_args", {}).update(init_args)
    path = Path(directory) / f"{Path(config).stem}_{'_'.join(map(str, init_args.values()))}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def run_main(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``pl-fed`` in-process: ``(exit code, stdout, stderr)`` (parse errors exit through SystemExit)."""
    from pl_fedsparse.cli import main

    try:
        code = main(args)
    except SystemExit as e:
        code = int(e.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line(err: str, prefix: str = "error:") -> str:
    """The single line ``pl-fed`` wrote to stderr, starting with ``prefix`` (fails on more lines or a traceback)."""
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(prefix) and "Traceback" not in err, err
    return lines[0]


def metric_rows(run: Any) -> list[dict[str, Any]]:
    """A run directory's metrics.jsonl rows without their timings (what two runs of the same numbers share)."""
    import json
    from pathlib import Path

    return [{k: v for k, v in json.loads(x).items() if not k.startswith("time")}
            for x in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def fit_rows(args: list[str], capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    """Run ``pl-fed fit <args>`` (which must name ``--trainer.default_root_dir``), expect exit 0, return the evaluated
    rows of its metrics.jsonl (every round has a row; ``"evaluated": false`` ones carry costs only)."""
    import json
    from pathlib import Path

    code, _, err = run_main(["fit", *args], capsys)
    assert code == 0, err
    run = Path(args[args.index("--trainer.default_root_dir") + 1])
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["evaluated"]]


@pytest.fixture(autouse=True)
def _no_downloads(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test touches the network: ``data.download`` defaults to true, so torchvision's dataset downloads fail here
    as they do without network (a test that needs a download replaces the dataset class)."""
    import urllib.error

    import torchvision.datasets as tvd

    def offline(self: Any, *args: Any, **kwargs: Any) -> None:
        present = getattr(self, "_check_exists", None) or getattr(self, "_check_integrity", None)
        if callable(present) and present():  # as torchvision's own download() does: files there, nothing to fetch
            return
        raise urllib.error.URLError("downloads are disabled in the test suite")

    for cls in (tvd.CIFAR10, tvd.MNIST, tvd.EMNIST):  # CIFAR100 and FashionMNIST inherit these
        monkeypatch.setattr(cls, "download", offline)


@pytest.fixture(autouse=True)
def _quiet_logs() -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
