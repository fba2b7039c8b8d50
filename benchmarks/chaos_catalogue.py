"""The catalogue of ``benchmarks/chaos.py --catalogue``: bad inputs over the user's code and data, run directories
whose own entries are links, and checkpoints / ``run.json`` / ``config.yaml`` files from elsewhere that name modules
with a side effect.

Every :class:`Case` says how to build its scratch folder (the working directory of the run: the user's module file
``usermods.py``, data files, a finished run to resume, links), the ``pl-fed`` arguments, the expected exit status and
the expected one-line outcome (a substring of the one line ``pl-fed`` prints on stderr). :func:`judge` checks a run
of it, wherever it ran (a subprocess in ``chaos.py``, :func:`pl_fedsparse.cli.main` in-process in
``tests/test_chaos_catalogue.py``):

* the exit status;
* exactly one non-empty stderr line, starting with the expected prefix (``error:``; a warning is printed as the
  engine's log message itself), holding the expected text, and no ``Traceback``;
* a refusal writes nothing: the run directory is absent afterwards (or, when the case prepared one, unchanged to the
  byte and to the modification time); a stop after the run started leaves no ``.lock`` and no ``.tmp`` file;
* link cases: no file outside the run directory (the ``outside/`` folder the links point into) changes;
* provenance cases: no side-effect module was imported (no marker file, no module of that name loaded, and the
  standard library's ``this`` never printed its poem).

All paths in the arguments are relative to the scratch folder, which is the working directory of the run.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import io
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["CASES", "MARKER_MODULES", "Case", "digest", "judge", "prepare", "run_in_process", "snapshot"]

# ------------------------------------------------------------------------------------------------- the user's code
USERMODS = '''
"""A user's project with every kind of mistake (the catalogue's cases name one class each)."""
import numpy as np
import torch
from torch import nn

from pl_fedsparse import FederatedModule
from pl_fedsparse.callbacks import FederatedCallback
from pl_fedsparse.data import BaseDataset, FederatedDataModule


# ---- modules
class InitValueError(FederatedModule):
    def __init__(self, **kw):
        super().__init__(**kw)
        raise ValueError("my init is broken")


class InitKeyError(FederatedModule):
    def __init__(self, **kw):
        super().__init__(**kw)
        {}["missing"]


class ForwardRaises(FederatedModule):
    def forward(self, x):
        raise ValueError("bad forward")


class ForwardZeroDivision(FederatedModule):
    def forward(self, x):
        return 1 / 0


class EvalForwardRaises(FederatedModule):
    def forward(self, x):
        if not self.training:
            raise KeyError("eval broke")
        return super().forward(x)


class TrainForwardRaisesInFit(FederatedModule):
    def forward(self, x):
        if self.training and torch.is_grad_enabled():
            raise RuntimeError("broke only while training")
        return super().forward(x)


class WrongRowsEval(FederatedModule):
    def forward(self, x):
        out = super().forward(x)
        return out if self.training else out[:-1]


class WrongRowsTrain(FederatedModule):
    def forward(self, x):
        return super().forward(x)[:-1]


class Logits1D(FederatedModule):
    def forward(self, x):
        return super().forward(x)[:, 0]


class Logits3D(FederatedModule):
    def forward(self, x):
        return super().forward(x)[:, :, None]


class TooFewClasses(FederatedModule):
    def forward(self, x):
        return super().forward(x)[:, :2]


class TooManyClasses(FederatedModule):
    def forward(self, x):
        out = super().forward(x)
        return torch.cat([out, out], dim=1)


class IntLogits(FederatedModule):
    def forward(self, x):
        return super().forward(x).long()


class BoolLogits(FederatedModule):
    def forward(self, x):
        return super().forward(x) > 0


class ReturnsTuple(FederatedModule):
    def forward(self, x):
        out = super().forward(x)
        return out, out


class ReturnsDict(FederatedModule):
    def forward(self, x):
        return {"logits": super().forward(x)}


class ReturnsNone(FederatedModule):
    def forward(self, x):
        return None


class ReturnsList(FederatedModule):
    def forward(self, x):
        return super().forward(x).tolist()


class ReturnsNumpy(FederatedModule):
    def forward(self, x):
        return super().forward(x).detach().numpy()


class EvalReturnsNone(FederatedModule):
    def forward(self, x):
        return super().forward(x) if self.training else None


class LateEvalFails(FederatedModule):
    def forward(self, x):
        if not self.training and x.shape[0] == 7:
            raise IndexError("no row 7")
        return super().forward(x)


class StepNone(FederatedModule):
    def training_step(self, batch, batch_idx):
        return None


class StepVector(FederatedModule):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y, reduction="none")


class StepNan(FederatedModule):
    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * float("nan")


class StepInf(FederatedModule):
    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * float("inf")


class StepDictWithoutLoss(FederatedModule):
    def training_step(self, batch, batch_idx):
        return {"value": super().training_step(batch, batch_idx)}


class StepFloat(FederatedModule):
    def training_step(self, batch, batch_idx):
        return 1.0


class StepString(FederatedModule):
    def training_step(self, batch, batch_idx):
        return "loss"


class StepRaises(FederatedModule):
    def training_step(self, batch, batch_idx):
        raise ArithmeticError("my step is broken")


class StepNoGrad(FederatedModule):
    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx).detach()


class LossRaises(FederatedModule):
    def loss(self, logits, y):
        raise LookupError("my loss is broken")


class LossNan(FederatedModule):
    def loss(self, logits, y):
        return super().loss(logits, y) * float("nan")


class LossNotCallable(FederatedModule):
    loss = 3


class FitMetricsRaises(FederatedModule):
    def fit_metrics(self):
        raise ValueError("my metrics are broken")


class OptString(FederatedModule):
    def configure_optimizers(self):
        return "sgd"


class OptInt(FederatedModule):
    def configure_optimizers(self):
        return 7


class OptListOfStrings(FederatedModule):
    def configure_optimizers(self):
        return ["sgd", "adam"]


class OptEmptyList(FederatedModule):
    def configure_optimizers(self):
        return []


class OptDictWithoutOptimizer(FederatedModule):
    def configure_optimizers(self):
        return {"lr_scheduler": None}


class OptRaises(FederatedModule):
    def configure_optimizers(self):
        raise RuntimeError("no optimizer for you")


class OptNone(FederatedModule):
    def configure_optimizers(self):
        return None


class OptNoParams(FederatedModule):
    def configure_optimizers(self):
        return torch.optim.SGD([], lr=0.1)


class OnFitStartRaises(FederatedModule):
    def on_fit_start(self):
        raise ValueError("fit start broke")


class OnTrainEpochStartRaises(FederatedModule):
    def on_train_epoch_start(self):
        raise ValueError("epoch start broke")


class OnTrainBatchStartRaises(FederatedModule):
    def on_train_batch_start(self, batch, batch_idx):
        raise ValueError("batch start broke")


class OnTrainBatchEndRaises(FederatedModule):
    def on_train_batch_end(self, outputs, batch, batch_idx):
        raise ValueError("batch end broke")


class OnBeforeOptimizerStepRaises(FederatedModule):
    def on_before_optimizer_step(self, optimizer):
        raise ValueError("optimizer step broke")


class StateDictRaises(FederatedModule):
    def state_dict(self, *args, **kwargs):
        raise RuntimeError("cannot save me")


class NotAModule:
    def __init__(self, **kw):
        pass


def make_model(**kw):
    return FederatedModule(**kw)


class NoParameters(FederatedModule):
    def __init__(self, **kw):
        super().__init__(**kw)
        for p in self.parameters():
            p.requires_grad_(False)


# ---- backbones
class BackboneInitRaises(nn.Module):
    def __init__(self, num_classes: int = 4):
        super().__init__()
        raise ValueError("my backbone cannot be built")


class BackboneForwardRaises(nn.Module):
    def __init__(self, num_classes: int = 4):
        super().__init__()
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x):
        raise NotImplementedError("forward is not written yet")


class BackboneWrongInput(nn.Module):
    def __init__(self, num_classes: int = 4):
        super().__init__()
        self.fc = nn.Linear(13, num_classes)

    def forward(self, x):
        return self.fc(x.flatten(1))


class NotANet:
    def __init__(self, num_classes: int = 4):
        pass


# ---- callbacks
class _Raises(FederatedCallback):
    hook = ""

    def _boom(self, *args, **kwargs):
        raise RuntimeError(f"{type(self).__name__} broke")


class CbInitRaises(FederatedCallback):
    def __init__(self):
        super().__init__()
        raise ValueError("my callback cannot be built")


class CbSetupRaises(_Raises):
    setup_federation = _Raises._boom


class CbFederationStartRaises(_Raises):
    on_federation_start = _Raises._boom


class CbRoundStartRaises(_Raises):
    on_round_start = _Raises._boom


class CbClientFitStartRaises(_Raises):
    on_client_fit_start = _Raises._boom


class CbClientFitEndRaises(_Raises):
    on_client_fit_end = _Raises._boom


class CbBeforeAggregateRaises(_Raises):
    on_before_aggregate = _Raises._boom


class CbAfterAggregateRaises(_Raises):
    on_after_aggregate = _Raises._boom


class CbEvaluationEndRaises(_Raises):
    on_evaluation_end = _Raises._boom


class CbRoundEndRaises(_Raises):
    on_round_end = _Raises._boom


class CbFederationEndRaises(_Raises):
    on_federation_end = _Raises._boom


class CbClientMessageRaises(_Raises):
    on_client_message = _Raises._boom


class CbClientEvaluateStartRaises(_Raises):
    on_client_evaluate_start = _Raises._boom


class CbClientEvaluateEndRaises(_Raises):
    on_client_evaluate_end = _Raises._boom


class CbClientPredictionsRaises(_Raises):
    on_client_predictions = _Raises._boom


class CbEvalViewsRaises(_Raises):
    eval_views = _Raises._boom


class CbFitRequestsRaises(_Raises):
    fit_requests = _Raises._boom


class CbClientMessageRaisesPolicy(_Raises):
    client_message = _Raises._boom


class CbPersonalStateRaises(_Raises):
    personal_state = _Raises._boom


class CbTrainBatchEndRaises(_Raises):
    on_train_batch_end = _Raises._boom


class CbSelectClientsRaises(_Raises):
    select_clients = _Raises._boom


class CbSelectClientsUnknown(FederatedCallback):
    def select_clients(self, loop, round_idx, client_ids):
        return [99]


class CbAggregateRaises(_Raises):
    aggregate = _Raises._boom


class CbAggregateReturnsString(FederatedCallback):
    def aggregate(self, loop, updates):
        return "averaged"


class CbReportRowsRaises(_Raises):
    report_rows = _Raises._boom


class CbStateDictRaises(FederatedCallback):
    def state_dict(self):
        raise RuntimeError("cannot save my state")


class NotACallback:
    pass


# ---- data modules
def _split(x, y, n_test=40, **kw):
    return BaseDataset("mine", x[n_test:], y[n_test:], x[:n_test], y[:n_test], **kw)


def _xy(n=200, width=5, classes=3):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, width, generator=g), torch.arange(n) % classes


class DataInitRaises(FederatedDataModule):
    def __init__(self, **kw):
        super().__init__(**kw)
        raise ValueError("my data module cannot be built")


class LoadRaises(FederatedDataModule):
    def load_base_dataset(self):
        raise ZeroDivisionError("my loader divides by zero")


class LoadFileMissing(FederatedDataModule):
    def load_base_dataset(self):
        np.load("no-such-file.npy")


class LoadNone(FederatedDataModule):
    def load_base_dataset(self):
        return None


class LoadDict(FederatedDataModule):
    def load_base_dataset(self):
        x, y = _xy()
        return {"train_x": x, "train_y": y}


class LoadTuple(FederatedDataModule):
    def load_base_dataset(self):
        return _xy()


class LoadNumpyInputs(FederatedDataModule):
    def load_base_dataset(self):
        x, y = _xy()
        return BaseDataset("mine", x.numpy()[40:], y[40:], x.numpy()[:40], y[:40], num_classes=3)


class NumClassesZero(FederatedDataModule):
    def load_base_dataset(self):
        return _split(*_xy(), num_classes=0)


class NumClassesBool(FederatedDataModule):
    def load_base_dataset(self):
        return _split(*_xy(), num_classes=True)


class NumClassesText(FederatedDataModule):
    def load_base_dataset(self):
        return _split(*_xy(), num_classes="3")


class LabelTooLarge(FederatedDataModule):
    def load_base_dataset(self):
        x, y = _xy()
        y[5] = 3
        return _split(x, y, num_classes=3)


class LabelNegative(FederatedDataModule):
    def load_base_dataset(self):
        x, y = _xy()
        y[77] = -1
        return _split(x, y, num_classes=3)


class FloatLabels(FederatedDataModule):
    def load_base_dataset(self):
        x, y = _xy()
        return _split(x, y.float(), num_classes=3)


class BoolLabels(FederatedDataModule):
    def load_base_dataset(self):
        x, y = _xy()
        return _split(x, y > 0, num_classes=2)


class Labels2D(FederatedDataModule):
    def load_base_dataset(self):
        x, y = _xy()
        return _split(x, y[:, None], num_classes=3)


class LengthsDiffer(FederatedDataModule):
    def load_base_dataset(self):
        x, y = _xy()
        return BaseDataset("mine", x[40:], y[50:], x[:40], y[:40], num_classes=3)


class TestLengthsDiffer(FederatedDataModule):
    def load_base_dataset(self):
        x, y = _xy()
        return BaseDataset("mine", x[40:], y[40:], x[:40], y[:30], num_classes=3)


class NanFeatures(FederatedDataModule):
    def load_base_dataset(self):
        x, y = _xy()
        x[60, 1] = float("nan")
        return _split(x, y, num_classes=3)


class InfFeatures(FederatedDataModule):
    def load_base_dataset(self):
        x, y = _xy()
        x[3, 0] = float("inf")
        return _split(x, y, num_classes=3)


class EmptyTest(FederatedDataModule):
    def load_base_dataset(self):
        x, y = _xy()
        return BaseDataset("mine", x, y, x[:0], y[:0], num_classes=3)


class EmptyTrain(FederatedDataModule):
    def load_base_dataset(self):
        x, y = _xy()
        return BaseDataset("mine", x[:0], y[:0], x, y, num_classes=3)


class TestShapeDiffers(FederatedDataModule):
    def load_base_dataset(self):
        x, y = _xy()
        return BaseDataset("mine", x[40:], y[40:], x[:40, :4], y[:40], num_classes=3)


class TestKindDiffers(FederatedDataModule):
    def load_base_dataset(self):
        x, y = _xy()
        return BaseDataset("mine", x[40:], y[40:], x[:40].long(), y[:40], num_classes=3)


class StdZero(FederatedDataModule):
    def load_base_dataset(self):
        return _split(*_xy(), num_classes=3, mean=(0.0,) * 5, std=(1.0, 1.0, 0.0, 1.0, 1.0))


class MeanWrongLength(FederatedDataModule):
    def load_base_dataset(self):
        return _split(*_xy(), num_classes=3, mean=(0.0, 0.0), std=(1.0, 1.0))


class MeanForTokens(FederatedDataModule):
    def load_base_dataset(self):
        x, y = _xy()
        return _split((x.abs() * 10).long(), y, num_classes=3, mean=(0.0,), std=(1.0,))


class ImagesWithoutStats(FederatedDataModule):
    def load_base_dataset(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, 255, (200, 1, 8, 8), generator=g).to(torch.uint8)
        return _split(x, torch.arange(200) % 4, num_classes=4)


class TestClientOnly(FederatedDataModule):
    def load_base_dataset(self):
        return _split(*_xy(), num_classes=3, test_client=torch.arange(40) % 4)


class ClientIdsTooShort(FederatedDataModule):
    def load_base_dataset(self):
        return _split(*_xy(), num_classes=3, train_client=torch.arange(100) % 4, test_client=torch.arange(40) % 4)


class FloatClientIds(FederatedDataModule):
    def load_base_dataset(self):
        return _split(*_xy(), num_classes=3, train_client=(torch.arange(160) % 4).float(),
                      test_client=torch.arange(40) % 4)


class StringInputs(FederatedDataModule):
    def load_base_dataset(self):
        _, y = _xy()
        return BaseDataset("mine", ["a"] * 160, y[40:], ["b"] * 40, y[:40], num_classes=3)
'''

# ------------------------------------------------------------------------------------------------- side effects
#: module names a crafted file names; each writes ``<its name>.imported`` next to itself when imported
MARKER_MODULES = ("sidefx", "sidefx_data", "sidefx_cb", "sidefx_backbone", "sidefx_exec", "sidefx_topology",
                  "json_tools", "os_utils", "typing_compat")
SIDE_EFFECT = '''
from pathlib import Path
Path(__file__).with_suffix(".imported").write_text("imported")

class Evil:
    def __init__(self, *args, **kwargs):
        Path(__file__).with_suffix(".instantiated").write_text("instantiated")
'''
#: the standard library's own module with a side effect on import (it prints the Zen of Python)
ZEN = "Beautiful is better than ugly"

# ------------------------------------------------------------------------------------------------- the base run
COMMON = ("fit", "--seed_everything", "0", "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false",
          "--trainer.num_rounds", "1", "--trainer.default_root_dir", "run")
#: the tiny synthetic task of tests/conftest.py (4 classes, 8x8 grey images)
SYN_DATA = ("--data.name", "synthetic", "--data.num_clients", "4", "--data.batch_size", "16", "--data.synthetic",
            '{"num_train": 400, "num_test": 100, "size": 8, "channels": 1, "num_classes": 4}')
SYN_MLP = ("--model.backbone", "pl_fedsparse.models.MLP", "--model.backbone.init_args.num_classes", "4",
           "--model.backbone.init_args.in_channels", "1", "--model.backbone.init_args.input_size", "8",
           "--model.backbone.init_args.hidden", "[16]")
#: a table of 5 features, 3 classes, 4 natural clients (``t.npz``)
TAB_MLP = ("--model.backbone", "pl_fedsparse.models.MLP", "--model.backbone.init_args.num_classes", "3",
           "--model.backbone.init_args.in_features", "5", "--model.backbone.init_args.hidden", "[16]")
TAB_DATA = ("--data.name", "tensors", "--data.root", "t.npz", "--data.partition", "natural", "--data.num_clients",
            "null", "--data.batch_size", "8")
#: a user data module of 5 features, 3 classes, 4 clients
DM_DATA = ("--data.init_args.num_clients", "4", "--data.init_args.partition", "iid", "--data.init_args.batch_size",
           "16")


def _user_model(cls: str) -> tuple[str, ...]:
    return ("--model", f"usermods.{cls}", *(a.replace("--model.", "--model.init_args.", 1) for a in SYN_MLP))


def _arrays(n: int = 120, clients: int = 4) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"x": rng.normal(size=(n, 5)).astype(np.float32), "y": np.arange(n) % 3, "client": np.arange(n) % clients}


def _split_arrays(n: int = 120) -> dict[str, np.ndarray]:
    a = _arrays(n)
    return {"train_x": a["x"][30:], "train_y": a["y"][30:], "test_x": a["x"][:30], "test_y": a["y"][:30]}


# ------------------------------------------------------------------------------------------------- the case type
Builder = Callable[[Path], None]


@dataclass(frozen=True)
class Case:
    """One catalogue entry.

    Attributes:
        id: a short unique name (the test's parameter id).
        group: ``"input"`` (the user's code, data and config), ``"link"`` or ``"provenance"``.
        args: the ``pl-fed`` arguments, relative to the scratch folder (the run's working directory).
        code: the expected exit status.
        expect: a substring of the one stderr line; ``""`` with ``code`` 0: no line at all.
        prefix: how that line starts (``"error:"``; a warning starts with its own text).
        build: writes the case's files into the scratch folder (before the run).
        started: the refusal comes after the run started (every fit failed, a hook of a round raised): the run
            directory holds the start checkpoint, and must hold no ``.lock`` and no ``.tmp`` file afterwards.
        note: what the case is about (printed by ``chaos.py --catalogue``).
    """

    id: str
    group: str
    args: tuple[str, ...]
    code: int
    expect: str
    prefix: str = "error:"
    build: tuple[Builder, ...] = ()
    started: bool = False
    note: str = ""
    env: tuple[tuple[str, str], ...] = field(default=())


def _usermods(d: Path) -> None:
    (d / "usermods.py").write_text(USERMODS)


def _npz(name: str = "t.npz", **arrays: Any) -> Builder:
    def build(d: Path) -> None:
        with open(d / name, "wb") as f:
            np.savez(f, **arrays)
    return build


def _write(name: str, content: str | bytes) -> Builder:
    def build(d: Path) -> None:
        p = d / name
        p.parent.mkdir(parents=True, exist_ok=True)
        (p.write_bytes if isinstance(content, bytes) else p.write_text)(content)  # type: ignore[operator]
    return build


def _images(layout: dict[str, list[tuple[int, int]]], corrupt: str | None = None, flip: str | None = None) -> Builder:
    """``imgs/<folder>/<i>.png`` for each folder of ``layout`` (a list of image sizes; empty: an empty folder);
    ``corrupt``: a file of that name that is no image; ``flip``: that image with one bit of its image data flipped
    (torchvision's PNG decoder crashes the process on it)."""
    def build(d: Path) -> None:
        from PIL import Image

        for folder, sizes in layout.items():
            (d / "imgs" / folder).mkdir(parents=True, exist_ok=True)
            for i, (w, h) in enumerate(sizes):
                Image.new("RGB", (w, h), (i * 20 % 255, 40, 90)).save(d / "imgs" / folder / f"{i}.png")
        if corrupt:
            (d / "imgs" / corrupt).write_bytes(b"\x89PNG not really an image")
        if flip:
            data = bytearray((d / "imgs" / flip).read_bytes())
            data[data.index(b"IDAT") + 6] ^= 0x10  # (inside the zlib stream: its CRC no longer matches)
            (d / "imgs" / flip).write_bytes(bytes(data))
    return build


# ------------------------------------------------------------------------------------------------- bad inputs
def _input_cases() -> list[Case]:
    cases: list[Case] = []

    def add(cid: str, args: tuple[str, ...], code: int, expect: str, *build: Builder, prefix: str = "error:",
            started: bool = False, note: str = "") -> None:
        cases.append(Case(cid, "input", args, code, expect, prefix, tuple(build), started, note))

    syn = (*COMMON, *SYN_DATA)

    # ---- the user's module: every hook the engine calls
    def mod(cid: str, cls: str, code: int, expect: str, *extra: str, started: bool = False) -> None:
        add(cid, (*syn, *_user_model(cls), *extra), code, expect, _usermods, started=started)

    mod("module-init-valueerror", "InitValueError", 1, "usermods.InitValueError.__init__ raised: my init is broken")
    mod("module-init-keyerror", "InitKeyError", 1, "usermods.InitKeyError.__init__ raised: 'missing'")
    mod("module-forward-raises", "ForwardRaises", 1,
        "ForwardRaises.forward raised ValueError: bad forward (the model check: a batch of 2 from data.name='synthetic')")
    mod("module-forward-zerodivision", "ForwardZeroDivision", 1,
        "ForwardZeroDivision.forward raised ZeroDivisionError: division by zero (the model check")
    mod("module-eval-forward-raises", "EvalForwardRaises", 1,
        "EvalForwardRaises.forward raised KeyError: 'eval broke' (the model check: a batch of 2 from "
        "data.name='synthetic', eval mode)")
    mod("module-forward-raises-in-fit", "TrainForwardRaisesInFit", 1,
        "TrainForwardRaisesInFit.forward raised RuntimeError: broke only while training (counting the FLOPs of a "
        "training step on a batch of 2, train mode)")
    mod("module-eval-wrong-rows", "WrongRowsEval", 2,
        "model=WrongRowsEval is invalid: expected forward(x) in eval mode to return one row of logits per input, "
        "got 1 rows for a batch of 2")
    mod("module-train-wrong-rows", "WrongRowsTrain", 2,
        "model=WrongRowsTrain is invalid: expected forward(x) to return one row of logits per input, got 1 rows")
    width = "is invalid: expected 4 (the number of classes of data.name='synthetic'; forward(x) returned shape "
    mod("module-logits-1d", "Logits1D", 2, "model.backbone.init_args.num_classes=2 " + width + "(2,))")
    mod("module-logits-3d", "Logits3D", 2, "model.backbone.init_args.num_classes=1 " + width + "(2, 4, 1))")
    mod("module-too-few-classes", "TooFewClasses", 2, "model.backbone.init_args.num_classes=2 " + width + "(2, 2))")
    mod("module-too-many-classes", "TooManyClasses", 2, "model.backbone.init_args.num_classes=8 " + width + "(2, 8))")
    mod("module-int-logits", "IntLogits", 2, "model=IntLogits is invalid: expected forward(x) to return a float "
                                             "tensor of logits [batch, 4], got Tensor")
    mod("module-bool-logits", "BoolLogits", 2, "model=BoolLogits is invalid: expected forward(x) to return a float "
                                               "tensor of logits [batch, 4], got Tensor")
    mod("module-returns-tuple", "ReturnsTuple", 2, "model=ReturnsTuple is invalid: expected forward(x) to return a "
                                                   "float tensor of logits [batch, 4], got tuple")
    mod("module-returns-dict", "ReturnsDict", 2, "model=ReturnsDict is invalid: expected forward(x) to return a "
                                                 "float tensor of logits [batch, 4], got dict")
    mod("module-returns-none", "ReturnsNone", 2, "model=ReturnsNone is invalid: expected forward(x) to return a "
                                                 "float tensor of logits [batch, 4], got NoneType")
    mod("module-returns-list", "ReturnsList", 2, "model=ReturnsList is invalid: expected forward(x) to return a "
                                                 "float tensor of logits [batch, 4], got list")
    mod("module-returns-numpy", "ReturnsNumpy", 2, "model=ReturnsNumpy is invalid: expected forward(x) to return a "
                                                   "float tensor of logits [batch, 4], got ndarray")
    mod("module-eval-returns-none", "EvalReturnsNone", 2,
        "model=EvalReturnsNone is invalid: expected forward(x) to return a float tensor of logits [batch, 4], got "
        "NoneType")
    mod("module-forward-fails-in-evaluation", "LateEvalFails", 1,
        "LateEvalFails.forward raised IndexError: no row 7 (client", "--data.eval_batch_size", "7", started=True)
    mod("module-step-none", "StepNone", 1, "round 0: every participant's fit failed (no_loss x4; the first: client 0: "
                                           "no_loss: training_step returned None", started=True)
    mod("module-step-vector", "StepVector", 1, "round 0: every participant's fit failed", started=True)
    mod("module-step-nan", "StepNan", 1, "round 0: every participant's fit failed (nonfinite_loss x4", started=True)
    mod("module-step-inf", "StepInf", 1, "round 0: every participant's fit failed (nonfinite_loss x4", started=True)
    step_rule = "expected the loss tensor, a dict holding it under 'loss', or None to skip the batch"
    mod("module-step-dict-without-loss", "StepDictWithoutLoss", 2,
        f"StepDictWithoutLoss.training_step returned a dict without a 'loss' tensor (keys: 'value'): {step_rule}",
        started=True)
    mod("module-step-float", "StepFloat", 2, f"StepFloat.training_step returned a float: {step_rule}", started=True)
    mod("module-step-string", "StepString", 2, f"StepString.training_step returned a str: {step_rule}", started=True)
    mod("module-step-raises", "StepRaises", 1, "round 0: every participant's fit failed (exception x4; the first: "
                                               "client 0: exception: StepRaises.training_step raised "
                                               "ArithmeticError: my step is broken", started=True)
    mod("module-step-no-grad", "StepNoGrad", 1, "round 0: every participant's fit failed", started=True)
    mod("module-loss-raises", "LossRaises", 1, "round 0: every participant's fit failed (exception x4; the first: "
                                               "client 0: exception: LossRaises.loss raised LookupError: my loss is "
                                               "broken", started=True)
    mod("module-loss-nan", "LossNan", 1, "round 0: every participant's fit failed (nonfinite_loss x4", started=True)
    mod("module-loss-not-callable", "LossNotCallable", 2, "model=LossNotCallable.loss is invalid: expected a method")
    mod("module-fit-metrics-raises", "FitMetricsRaises", 1, "round 0: every participant's fit failed", started=True)
    opt_rule = "Unknown configuration for model optimizers. Output from `model.configure_optimizers()` should be one of"
    mod("module-optimizers-string", "OptString", 2, opt_rule, started=True)
    mod("module-optimizers-int", "OptInt", 2, opt_rule, started=True)
    mod("module-optimizers-list-of-strings", "OptListOfStrings", 2, opt_rule, started=True)
    mod("module-optimizers-empty-list", "OptEmptyList", 1, "round 0: every participant's fit failed", started=True)
    mod("module-optimizers-dict-without-optimizer", "OptDictWithoutOptimizer", 1,
        "round 0: every participant's fit failed", started=True)
    mod("module-optimizers-raise", "OptRaises", 1, "round 0: every participant's fit failed (exception x4; the "
                                                   "first: client 0: exception: OptRaises.configure_optimizers raised "
                                                   "RuntimeError: no optimizer for you", started=True)
    mod("module-optimizer-without-parameters", "OptNoParams", 1, "round 0: every participant's fit failed",
        started=True)
    mod("module-optimizers-none", "OptNone", 1, "round 0: every participant's fit failed (exception x4; the first: "
                                               "client 0: exception: UserCodeError: OptNone.configure_optimizers() "
                                               "returned no optimizer: a local fit needs one", started=True)
    for hook in ("OnFitStart", "OnTrainEpochStart", "OnTrainBatchStart", "OnTrainBatchEnd", "OnBeforeOptimizerStep"):
        mod(f"module-hook-{hook.lower()}-raises", f"{hook}Raises", 1, "round 0: every participant's fit failed "
                                                                        "(exception x4", started=True)
    mod("module-state-dict-raises", "StateDictRaises", 1, "StateDictRaises.state_dict raised RuntimeError: cannot "
                                                          "save me")
    mod("module-not-a-lightningmodule", "NotAModule", 2, "usermods.NotAModule")
    mod("module-a-function", "make_model", 2, "usermods.make_model")
    mod("module-no-trainable-parameters", "NoParameters", 2,
        "model=NoParameters is invalid: expected trainable parameters (it has none)")
    add("module-class-missing", (*syn, "--model", "usermods.NoSuchModel", *SYN_MLP[0:0]), 2, "usermods.NoSuchModel",
        _usermods)
    add("module-file-missing", (*syn, "--model", "nosuchmodule.Net"), 2, "nosuchmodule.Net")
    add("module-file-syntax-error", (*syn, "--model", "brokenmods.Net"), 2, "brokenmods",
        _write("brokenmods.py", "class Net(:\n    pass\n"))
    add("module-file-raises-on-import", (*syn, "--model", "raisingmods.Net"), 2, "raisingmods",
        _write("raisingmods.py", "raise ImportError('this module needs a GPU cluster')\n"))

    # ---- the backbone
    def bb(cid: str, cls: str, code: int, expect: str) -> None:
        add(cid, (*syn, "--model.backbone", f"usermods.{cls}", "--model.backbone.init_args.num_classes", "4"), code,
            expect, _usermods)

    bb("backbone-init-raises", "BackboneInitRaises", 1, "usermods.BackboneInitRaises.__init__ raised: my backbone "
                                                        "cannot be built (while building the configured classes)")
    bb("backbone-forward-raises", "BackboneForwardRaises", 2,
       "model.backbone=BackboneForwardRaises is invalid: expected a network accepting inputs of shape (1, 8, 8) "
       "(torch.float32) from data.name='synthetic' (forward is not written yet)")
    bb("backbone-wrong-input-width", "BackboneWrongInput", 2,
       "model.backbone=BackboneWrongInput is invalid: expected a network accepting inputs of shape (1, 8, 8)")
    bb("backbone-not-a-module", "NotANet", 2, "model.backbone.class_path='usermods.NotANet' is invalid: expected a "
                                               "torch.nn.Module subclass")

    # ---- callbacks: every hook the loop calls
    def cb(cid: str, cls: str, code: int, expect: str, started: bool = True) -> None:
        add(cid, (*syn, *SYN_MLP, "--trainer.callbacks+=usermods." + cls), code, expect, _usermods, started=started)

    cb("callback-init-raises", "CbInitRaises", 1, "usermods.CbInitRaises.__init__ raised: my callback cannot be "
                                                  "built", started=False)
    cb("callback-setup-federation-raises", "CbSetupRaises", 1,
       "CbSetupRaises.setup_federation raised RuntimeError: CbSetupRaises broke", started=False)
    cb("callback-federation-start-raises", "CbFederationStartRaises", 1,
       "CbFederationStartRaises.on_federation_start raised RuntimeError: CbFederationStartRaises broke")
    for cls, hook in (("CbRoundStartRaises", "on_round_start"), ("CbClientFitStartRaises", "on_client_fit_start"),
                      ("CbClientFitEndRaises", "on_client_fit_end"),
                      ("CbBeforeAggregateRaises", "on_before_aggregate"),
                      ("CbAfterAggregateRaises", "on_after_aggregate"),
                      ("CbEvaluationEndRaises", "on_evaluation_end"), ("CbRoundEndRaises", "on_round_end"),
                      ("CbFederationEndRaises", "on_federation_end"), ("CbSelectClientsRaises", "select_clients"),
                      ("CbAggregateRaises", "aggregate"), ("CbReportRowsRaises", "report_rows"),
                      ("CbClientMessageRaises", "on_client_message"),
                      ("CbClientEvaluateStartRaises", "on_client_evaluate_start"),
                      ("CbClientEvaluateEndRaises", "on_client_evaluate_end"),
                      ("CbClientPredictionsRaises", "on_client_predictions"), ("CbEvalViewsRaises", "eval_views"),
                      ("CbFitRequestsRaises", "fit_requests"), ("CbClientMessageRaisesPolicy", "client_message"),
                      ("CbPersonalStateRaises", "personal_state")):
        cb(f"callback-{hook.replace('_', '-')}-raises", cls, 1, f"{cls}.{hook} raised RuntimeError: {cls} broke")
    cb("callback-train-batch-end-raises", "CbTrainBatchEndRaises", 1,
       "round 0: every participant's fit failed (exception x4")
    cb("callback-selects-unknown-clients", "CbSelectClientsUnknown", 1,
       "CbSelectClientsUnknown.select_clients returned [99]: expected a list of client ids in [0, 4) (round 0)")
    cb("callback-aggregate-returns-text", "CbAggregateReturnsString", 1, "CbAggregateReturnsString.aggregate")
    cb("callback-state-dict-raises", "CbStateDictRaises", 1, "CbStateDictRaises.state_dict raised RuntimeError: "
                                                             "cannot save my state (saving the checkpoint")
    cb("callback-not-a-callback", "NotACallback", 2, "usermods.NotACallback", started=False)
    add("callback-module-missing", (*syn, *SYN_MLP, "--trainer.callbacks+=nosuchcallbacks.Cb"), 2, "nosuchcallbacks")

    # ---- the user's data module
    def dm(cid: str, cls: str, code: int, expect: str) -> None:
        add(cid, (*COMMON, *TAB_MLP, "--data", f"usermods.{cls}", *DM_DATA), code, expect, _usermods)

    owner = "{}.load_base_dataset() returned "
    dm("data-init-raises", "DataInitRaises", 1, "usermods.DataInitRaises.__init__ raised: my data module cannot be "
                                                "built")
    dm("data-load-raises", "LoadRaises", 1, "LoadRaises.load_base_dataset raised ZeroDivisionError: my loader "
                                            "divides by zero")
    dm("data-load-file-missing", "LoadFileMissing", 2, "no-such-file.npy")
    dm("data-load-returns-none", "LoadNone", 2, owner.format("LoadNone") + "a NoneType: expected a "
                                                                           "pl_fedsparse.data.BaseDataset")
    dm("data-load-returns-dict", "LoadDict", 2, owner.format("LoadDict") + "a dict: expected a "
                                                                           "pl_fedsparse.data.BaseDataset")
    dm("data-load-returns-tuple", "LoadTuple", 2, owner.format("LoadTuple") + "a tuple: expected a "
                                                                              "pl_fedsparse.data.BaseDataset")
    dm("data-numpy-inputs", "LoadNumpyInputs", 2, owner.format("LoadNumpyInputs") + "train_x as a numpy float32 array")
    dm("data-num-classes-zero", "NumClassesZero", 2, owner.format("NumClassesZero") + "num_classes=0: expected an "
                                                                                      "int >= 1")
    dm("data-num-classes-bool", "NumClassesBool", 2, owner.format("NumClassesBool") + "num_classes=True: expected an "
                                                                                      "int >= 1")
    dm("data-num-classes-text", "NumClassesText", 2, owner.format("NumClassesText") + "num_classes='3': expected an "
                                                                                      "int >= 1")
    dm("data-label-too-large", "LabelTooLarge", 2, "returned test_y with a label 3: expected labels in [0, 3)")
    dm("data-label-negative", "LabelNegative", 2, "returned train_y with a label -1: expected labels in [0, 3)")
    dm("data-float-labels", "FloatLabels", 2, owner.format("FloatLabels") + "train_y as a float32 tensor")
    dm("data-bool-labels", "BoolLabels", 2, owner.format("BoolLabels") + "train_y as a bool tensor")
    dm("data-labels-2d", "Labels2D", 2, owner.format("Labels2D") + "train_y as a int64 tensor of shape (160, 1)")
    dm("data-train-lengths-differ", "LengthsDiffer", 2, owner.format("LengthsDiffer") +
       "train_x of length 160 and train_y of length 150: expected one label per input")
    dm("data-test-lengths-differ", "TestLengthsDiffer", 2, owner.format("TestLengthsDiffer") +
       "test_x of length 40 and test_y of length 30")
    dm("data-nan-features", "NanFeatures", 2, owner.format("NanFeatures") +
       "train_x with non-finite values (NaN or inf) in 1 row(s), the first row 20")
    dm("data-inf-features", "InfFeatures", 2, owner.format("InfFeatures") +
       "test_x with non-finite values (NaN or inf) in 1 row(s), the first row 3")
    dm("data-empty-test-split", "EmptyTest", 2, owner.format("EmptyTest") + "no test split (0 samples)")
    dm("data-empty-train-split", "EmptyTrain", 2, owner.format("EmptyTrain") + "no train split (0 samples)")
    dm("data-test-shape-differs", "TestShapeDiffers", 2, owner.format("TestShapeDiffers") +
       "inputs of shapes (5,) (train) and (4,) (test): expected one input shape")
    dm("data-test-kind-differs", "TestKindDiffers", 2, owner.format("TestKindDiffers") + "test_x as a int64 tensor")
    dm("data-std-zero", "StdZero", 2, owner.format("StdZero") + "mean=")
    dm("data-mean-wrong-length", "MeanWrongLength", 2, owner.format("MeanWrongLength") + "mean=(0.0, 0.0)")
    dm("data-mean-for-tokens", "MeanForTokens", 2, owner.format("MeanForTokens") + "mean=(0.0,), std=(1.0,) for "
                                                                                   "tokens inputs")
    dm("data-images-without-stats", "ImagesWithoutStats", 2, owner.format("ImagesWithoutStats") +
       "mean=None, std=None: expected 1 per-channel values")
    dm("data-test-client-without-train-client", "TestClientOnly", 2, owner.format("TestClientOnly") +
       "test_client without train_client")
    dm("data-client-ids-too-short", "ClientIdsTooShort", 2, owner.format("ClientIdsTooShort") +
       "train_client as a int64 tensor of shape (100,): expected 160 integer client ids")
    dm("data-float-client-ids", "FloatClientIds", 2, owner.format("FloatClientIds") +
       "train_client as a float32 tensor")
    dm("data-string-inputs", "StringInputs", 2, owner.format("StringInputs") + "train_x as a list")

    # ---- .npz files
    tab = (*COMMON, *TAB_MLP, *TAB_DATA)
    a, s = _arrays(), _split_arrays()
    nan_x = a["x"].copy()
    nan_x[[7, 50], 2] = np.nan
    inf_x = a["x"].copy()
    inf_x[11, 0] = np.inf
    ninf_x = a["x"].copy()
    ninf_x[0, 4] = -np.inf
    bad_label = a["y"].copy()
    bad_label[9] = 7
    neg_label = a["y"].copy()
    neg_label[4] = -2

    def npz(cid: str, code: int, expect: str, *extra: str, prefix: str = "error:", **arrays: Any) -> None:
        add(cid, (*tab, *extra), code, expect, _npz(**arrays), prefix=prefix)

    root = "/t.npz' is invalid: expected "
    unreadable = "/t.npz' is invalid: cannot read it"
    npz("npz-x-y-lengths-differ", 2, root + "x and y of one length (got 120 and 100)", x=a["x"], y=a["y"][:100],
        client=a["client"])
    npz("npz-client-ids-short", 2, "one client id per sample: client of length 80 and x, y of length 120",
        x=a["x"], y=a["y"], client=a["client"][:80])
    npz("npz-nan-features", 2, "returned train_x with non-finite values (NaN or inf)", x=nan_x, y=a["y"],
        client=a["client"])
    npz("npz-inf-features", 2, "with non-finite values (NaN or inf) in 1 row(s)", x=inf_x, y=a["y"],
        client=a["client"])
    npz("npz-negative-inf-features", 2, "with non-finite values (NaN or inf) in 1 row(s)", x=ninf_x, y=a["y"],
        client=a["client"])
    npz("npz-label-out-of-range", 2, "with a label 7: expected labels in [0, 3) (num_classes=3)", x=a["x"],
        y=bad_label, client=a["client"], num_classes=np.array(3))
    npz("npz-negative-label", 2, "with a label -2: expected labels in [0, 3)", x=a["x"], y=neg_label,
        client=a["client"])
    npz("npz-float-labels", 2, "data.name='tensors' returned train_y as a float", x=a["x"], y=a["y"].astype(np.float32),
        client=a["client"])
    npz("npz-bool-labels", 2, "data.name='tensors' returned train_y as a bool tensor", x=a["x"], y=a["y"] > 0,
        client=a["client"])
    npz("npz-labels-2d", 2, "data.name='tensors' returned train_y as a int64 tensor of shape", x=a["x"],
        y=a["y"][:, None], client=a["client"])
    npz("npz-string-labels", 2, "/t.npz' is invalid: its y holds <U3 values; expected numbers", x=a["x"],
        y=np.array(["cat"] * 120),
        client=a["client"])
    npz("npz-object-array", 2, unreadable + " (not an archive of arrays: numpy would have to unpickle it, which "
        "pl_fedsparse never does)", x=np.array([object()] * 120, dtype=object),
        y=a["y"])
    npz("npz-empty", 2, "data.name='tensors' returned no train split (0 samples)", x=a["x"][:0], y=a["y"][:0])
    npz("npz-missing-test-arrays", 2, root + "train_x, train_y, test_x and test_y (or x and y) with "
        "train_client/test_client ids (missing test_x, test_y)", train_x=s["train_x"], train_y=s["train_y"])
    npz("npz-unknown-key", 2, "keys among", x=a["x"], y=a["y"], labels=a["y"])
    npz("npz-both-layouts", 2, root + "either x and y (split by data.test_fraction) or train_x, train_y, test_x and "
        "test_y", x=a["x"], y=a["y"], **s)
    npz("npz-client-with-split-layout", 2, "client needs x and y", client=a["client"][30:], **s)
    npz("npz-num-classes-zero", 2, "returned num_classes=0: expected an int >= 1", x=a["x"], y=a["y"],
        client=a["client"], num_classes=np.array(0))
    npz("npz-num-classes-float", 2, "returned num_classes=", x=a["x"], y=a["y"], client=a["client"],
        num_classes=np.array(2.5))
    npz("npz-num-classes-array", 2, "returned num_classes=", x=a["x"], y=a["y"], client=a["client"],
        num_classes=np.array([3, 3]))
    npz("npz-std-zero", 2, "returned mean=", x=a["x"], y=a["y"], client=a["client"], mean=np.zeros(5),
        std=np.array([1.0, 1.0, 0.0, 1.0, 1.0]))
    npz("npz-mean-wrong-length", 2, "returned mean=", x=a["x"], y=a["y"], client=a["client"], mean=np.zeros(3),
        std=np.ones(3))
    npz("npz-test-width-differs", 2, "inputs of shapes (5,) (train) and (4,) (test): expected one input shape",
        train_x=s["train_x"], train_y=s["train_y"], test_x=s["test_x"][:, :4], test_y=s["test_y"])
    npz("npz-complex-features", 2, "data.name='tensors' returned train_x as a complex64 tensor", x=a["x"] * 1j,
        y=a["y"], client=a["client"])
    npz("npz-no-test-sample-anywhere", 2, "returned no test split (0 samples): expected at least one test sample",
        x=a["x"][:4], y=a["y"][:4], client=np.arange(4))
    npz("npz-natural-without-client-ids", 2, "data.partition='natural'", x=a["x"], y=a["y"])
    npz("npz-float-client-ids", 2, "train_client as a float", x=a["x"], y=a["y"], client=a["client"] + 0.5)
    npz("npz-model-width-differs", 2, "model.backbone=MLP is invalid: expected a network accepting inputs of shape "
        "(7,)", x=np.zeros((120, 7), np.float32), y=a["y"], client=a["client"])
    npz("npz-more-classes-than-the-model", 2, "model.backbone.init_args.num_classes=3 is invalid: expected 5 (the "
        "number of classes of data.name='tensors'", x=a["x"], y=np.arange(120) % 5,
        client=a["client"])
    npz("npz-test-client-without-training-data", 2, "data.partition='natural' is invalid: data.name='tensors' has "
        "test_client id 3 without training samples; expected every test client id among the train_client ids",
        train_x=s["train_x"], train_y=s["train_y"], train_client=np.arange(90) % 3, test_x=s["test_x"],
        test_y=s["test_y"], test_client=np.arange(30) % 4)
    npz("npz-client-without-test-data", 0,
        "client(s) 3 have no test sample: acc_mean and the other client metrics average the 3 clients that have",
        "--data.test_mode", "partition", prefix="client(s)", train_x=s["train_x"], train_y=s["train_y"],
        train_client=np.arange(90) % 4, test_x=s["test_x"], test_y=s["test_y"], test_client=np.arange(30) % 3)
    add("npz-file-missing", tab, 2, root + "an existing .pt or .npz file for data.name='tensors'")
    add("npz-root-is-a-folder", tab, 2, root + "an existing .pt or .npz file", lambda d: (d / "t.npz").mkdir())
    add("npz-corrupt-file", tab, 2, unreadable + " (File is not a zip file)", _write("t.npz", b"PK\x03\x04garbage"))
    add("npz-empty-file", tab, 2, unreadable + " (No data left in file)", _write("t.npz", b""))
    add("tensors-wrong-suffix", (*COMMON, *TAB_MLP, *TAB_DATA[:3], "t.csv", *TAB_DATA[4:]), 2,
        "/t.csv' is invalid: expected a .pt file saved with torch.save",
        _write("t.csv", "1,2,3\n"))

    def pt_tensor(d: Path) -> None:
        import torch

        torch.save(torch.zeros(3), d / "t.pt")

    def pt_pickle(d: Path) -> None:
        import pickle

        (d / "t.pt").write_bytes(pickle.dumps(Path("somewhere")))

    pt_args = (*COMMON, *TAB_MLP, *TAB_DATA[:3], "t.pt", *TAB_DATA[4:])
    add("pt-holds-a-tensor", pt_args, 2, "/t.pt' is invalid: expected a .pt file saved with torch.save", pt_tensor)
    add("pt-holds-a-pickled-object", pt_args, 2, "/t.pt' is invalid: cannot read it (Weights only load failed",
        pt_pickle)

    # ---- image folders
    img = (*COMMON, "--model.backbone", "pl_fedsparse.models.MLP", "--model.backbone.init_args.num_classes", "3",
           "--model.backbone.init_args.in_channels", "3", "--model.backbone.init_args.input_size", "8",
           "--model.backbone.init_args.hidden", "[16]", "--data.name", "image_folder", "--data.root", "imgs",
           "--data.num_clients", "2", "--data.partition", "iid", "--data.batch_size", "4")
    eight = [(8, 8)] * 6
    add("images-folder-missing", img, 2, "/imgs' is invalid: expected an existing image folder")
    add("images-root-is-a-file", img, 2, "/imgs' is invalid: expected an existing image folder",
        _write("imgs", "not a folder"))
    add("images-folder-empty", img, 2, "/imgs' is invalid: expected image files",
        lambda d: (d / "imgs").mkdir())
    add("images-class-folders-empty", img, 2, "/imgs' is invalid: expected image files",
        _images({"a": [], "b": [], "c": []}))
    add("images-an-empty-class-folder", img, 0, "/imgs': class folder(s) 'c' hold no image",
        _images({"a": eight, "b": eight, "c": []}), prefix="data.root=")
    add("images-sizes-differ", img, 2, "data.image_size", _images({"a": eight, "b": [(8, 8), (9, 7)] * 3,
                                                                   "c": eight}))
    add("images-corrupt-file", img, 2, "b/bad.png", _images({"a": eight, "b": eight, "c": eight},
                                                            corrupt="b/bad.png"))
    add("images-png-one-bit-flipped", img, 2, "b/1.png cannot be decoded (PNG chunk IDAT is damaged (CRC mismatch))",
        _images({"a": eight, "b": eight, "c": eight}, flip="b/1.png"))
    add("images-no-image-files", img, 2, "/imgs' is invalid: expected image files",
        _write("imgs/a/readme.txt", "no images here"))
    add("images-train-without-test", img, 2, "test", _images({"train/a": eight, "train/b": eight, "train/c": eight}))
    add("images-test-classes-differ", img, 2, "/imgs' is invalid: expected the same class folders in train/ and "
        "test/", _images({"train/a": eight, "train/b": eight,
                                                                           "train/c": eight, "test/a": eight,
                                                                           "test/x": eight, "test/c": eight}))

    # ---- config values
    def cfg(cid: str, code: int, expect: str, *extra: str, build: tuple[Builder, ...] = ()) -> None:
        add(cid, (*syn, *SYN_MLP, *extra), code, expect, *build)

    cfg("config-num-clients-zero", 2, "data.num_clients=0 is invalid", "--data.num_clients", "0")
    cfg("config-num-clients-negative", 2, "data.num_clients=-1 is invalid", "--data.num_clients", "-1")
    cfg("config-num-clients-text", 2, 'Parser key "num_clients"', "--data.num_clients", "many")
    cfg("config-batch-size-zero", 2, "data.batch_size=0 is invalid", "--data.batch_size", "0")
    cfg("config-alpha-negative", 2, "data.alpha=-1.0 is invalid", "--data.alpha", "-1")
    cfg("config-test-fraction-one", 2, "data.test_fraction", "--data.test_fraction", "1.0")
    cfg("config-partition-unknown", 2, "data.partition is invalid: 'by_magic' is not one of 'iid', 'dirichlet'",
        "--data.partition", "by_magic")
    cfg("config-data-name-unknown", 2, "data.name='mnist2' is invalid", "--data.name", "mnist2")
    cfg("config-split-ratios-sum", 2, "data.split_ratios", "--data.split_ratios", "[0.5, 0.0, 0.1]")
    cfg("config-lr-negative", 2, "model.lr=-0.1 is invalid: expected a number > 0", "--model.lr", "-0.1")
    cfg("config-lr-text", 2, "model.lr='fast' is invalid: expected a finite number", "--model.lr", "fast")
    cfg("config-optimizer-unknown", 2, "model.optimizer is invalid: 'rmsprop' is not one of 'sgd', 'adam'",
        "--model.optimizer", "rmsprop")
    cfg("config-momentum-one", 2, "model.momentum=1.0 is invalid", "--model.momentum", "1.0")
    cfg("config-num-rounds-zero", 2, "trainer.num_rounds=0 is invalid: expected an int >= 1",
        "--trainer.num_rounds", "0")
    cfg("config-eval-every-zero", 2, "trainer.eval_every=0 is invalid", "--trainer.eval_every", "0")
    cfg("config-clients-per-round-zero", 2, "trainer.clients_per_round=0 is invalid",
        "--trainer.clients_per_round", "0")
    cfg("config-join-ratio-above-one", 2, "trainer.join_ratio=1.5 is invalid", "--trainer.join_ratio", "1.5")
    cfg("config-local-epochs-zero", 2, "trainer.local_epochs=0 is invalid", "--trainer.local_epochs", "0")
    cfg("config-accelerator-unknown", 2, "trainer.accelerator", "--trainer.accelerator", "abacus")
    cfg("config-on-client-fault-unknown", 2, "trainer.on_client_fault", "--trainer.on_client_fault", "shrug")
    cfg("config-keep-checkpoints-zero", 2, "trainer.keep_checkpoints=0 is invalid", "--trainer.keep_checkpoints",
        "0")
    cfg("config-unknown-key", 2, "trainer.colour", "--trainer.colour", "blue")
    cfg("config-seed-text", 2, "seed_everything", "--seed_everything", "lucky")
    cfg("config-file-missing", 2, "nothere.yaml", "--config", "nothere.yaml")
    cfg("config-file-not-yaml", 2, "broken.yaml", "--config", "broken.yaml",
        build=(_write("broken.yaml", "trainer: [unclosed\n"),))
    cfg("config-file-a-list", 2, "list.yaml", "--config", "list.yaml", build=(_write("list.yaml", "- 1\n- 2\n"),))
    cfg("ckpt-path-missing", 2, "ckpt_path='nothere.ckpt' is invalid", "--ckpt_path", "nothere.ckpt")
    cfg("ckpt-path-a-folder", 2, "ckpt_path='somefolder' is invalid", "--ckpt_path", "somefolder",
        build=(lambda d: (d / "somefolder").mkdir(),))
    cfg("ckpt-path-garbage", 2, "ckpt_path='garbage.ckpt' is invalid", "--ckpt_path", "garbage.ckpt",
        build=(_write("garbage.ckpt", b"\x00\x01 not a checkpoint"),))
    cfg("ckpt-path-empty-file", 2, "ckpt_path='empty.ckpt' is invalid", "--ckpt_path", "empty.ckpt",
        build=(_write("empty.ckpt", b""),))
    cfg("root-dir-is-a-file", 2, "afile", "--trainer.default_root_dir", "afile",
        build=(_write("afile", "not a folder"),))
    cfg("root-dir-under-a-file", 2, "afile/run", "--trainer.default_root_dir", "afile/run",
        build=(_write("afile", "not a folder"),))
    cfg("root-dir-holds-a-finished-run", 2, "it already holds a run", build=(_finished_run,))
    return cases


# ------------------------------------------------------------------------------------------------- a finished run
_TEMPLATES: dict[str, Path] = {}
FINISHED_ARGS = (*COMMON, *TAB_MLP, *TAB_DATA, "--trainer.logger", "true")


def _finished_run(d: Path) -> None:
    """``t.npz`` and ``run/``: a finished one-round run of the tabular task (made once per process, then copied)."""
    key = "tab"
    if key not in _TEMPLATES:
        from pl_fedsparse.cli import main

        where = Path(tempfile.mkdtemp(prefix="catalogue-template-"))
        atexit.register(shutil.rmtree, where, ignore_errors=True)  # (made once per process: gone with it)
        _npz(**_arrays())(where)
        with _cwd(where), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as e:
            code = main(list(FINISHED_ARGS))
        if code != 0:
            raise RuntimeError(f"the template run failed ({code}): {e.getvalue()}")
        _TEMPLATES[key] = where
    src = _TEMPLATES[key]
    shutil.copy2(src / "t.npz", d / "t.npz")
    shutil.copytree(src / "run", d / "run", symlinks=True)


@contextlib.contextmanager
def _cwd(path: Path) -> Iterator[None]:
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


RESUME = (*FINISHED_ARGS[:FINISHED_ARGS.index("--trainer.num_rounds") + 1], "2",
          *FINISHED_ARGS[FINISHED_ARGS.index("--trainer.num_rounds") + 2:], "--ckpt_path", "run/checkpoints/last.ckpt")


# ------------------------------------------------------------------------------------------------- links
def _outside(d: Path) -> None:
    """``outside/``: the user's files elsewhere (a file, a TensorBoard-looking file, engine-looking temporaries)."""
    o = d / "outside"
    o.mkdir()
    (o / "target.txt").write_text("precious")
    (o / "events.out.tfevents.123.host").write_bytes(b"the user's events")
    (o / ".last.ckpt.0a1b2c3d.tmp").write_bytes(b"the user's file")
    (o / ".summary.json.abcdefgh.tmp").write_bytes(b"another user's file")
    (o / "round-000001.ckpt").write_bytes(b"the user's checkpoint-looking file")


def _link(entry: str, target: str) -> Builder:
    def build(d: Path) -> None:
        link = d / "run" / entry
        if link.is_dir() and not link.is_symlink():
            shutil.rmtree(link)
        elif link.exists() or link.is_symlink():
            link.unlink()
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(d / "outside" / target)
    return build


def _link_cases() -> list[Case]:
    cases = []
    fresh = (*COMMON, *TAB_MLP, *TAB_DATA)

    def refused(entry: str, target: str, args: tuple[str, ...], cid: str, base: Builder) -> None:
        cases.append(Case(cid, "link", args, 2, f"its {entry} is a symbolic link", "error:",
                          (_outside, base, _link(entry, target))))

    empty = _npz(**_arrays())
    saved = (*RESUME[:-1], "saved.ckpt")  # (a copy of the run's checkpoint: the link check, not the load, refuses)

    def finished_and_saved(d: Path) -> None:
        _finished_run(d)
        shutil.copyfile(d / "run" / "checkpoints" / "last.ckpt", d / "saved.ckpt")

    for entry, target in ((".lock", "target.txt"), ("run.json", "target.txt"), ("config.yaml", "target.txt"),
                          ("summary.json", "target.txt"), ("metrics.jsonl", "target.txt"),
                          ("results.md", "target.txt"), ("checkpoints", "."), ("tensorboard", "."),
                          ("checkpoints/last.ckpt", "target.txt")):
        name = entry.replace("/", "-").lstrip(".")
        if entry.startswith("checkpoints"):
            refused(entry, target, saved, f"link-{name}-on-resume", finished_and_saved)
        else:
            refused(entry, target, RESUME, f"link-{name}-on-resume", _finished_run)
        if entry in (".lock", "checkpoints", "tensorboard", "run.json"):
            refused(entry, target, (*FINISHED_ARGS, "--trainer.overwrite", "true"), f"link-{name}-on-overwrite",
                    _finished_run)
        if entry in (".lock", "checkpoints", "config.yaml"):
            refused(entry, target, fresh, f"link-{name}-in-a-new-directory", empty)

    def user_files(d: Path) -> None:
        (d / "run" / "notes.tmp").write_text("mine")
        (d / "run" / ".notes.tmp").write_text("mine")
        (d / "run" / "checkpoints" / ".mine.ckpt.tmp").write_text("mine")
        (d / "run" / ".last.ckpt.0a1b2c3d.tmp.bak").write_text("mine")
        (d / "run" / "checkpoints" / ".round-000001.ckpt.short.tmp").write_text("mine")

    def tmp_links(d: Path) -> None:
        (d / "run" / ".summary.json.0a1b2c3d.tmp").symlink_to(d / "outside" / "target.txt")
        (d / "run" / "checkpoints" / ".last.ckpt.abcdefgh.tmp").symlink_to(d / "outside")
        (d / "run" / "tensorboard" / "events.out.tfevents.1.link").symlink_to(d / "outside" / "target.txt")

    cases.append(Case("link-user-files-named-like-temporaries", "link", RESUME, 0, "", "", (
        _outside, _finished_run, user_files), note="resumed: the user's *.tmp files stay"))
    cases.append(Case("link-engine-named-temporaries-that-are-links", "link", RESUME, 0, "", "", (
        _outside, _finished_run, tmp_links), note="resumed: links named like the engine's temporaries stay"))
    cases.append(Case("link-engine-named-temporaries-that-are-links-on-overwrite", "link",
                      (*FINISHED_ARGS, "--trainer.overwrite", "true"), 0, "", "", (
                          _outside, _finished_run, tmp_links), note="overwritten: links are removed, never targets"))

    def symlinked_run_dir(d: Path) -> None:
        _finished_run(d)
        (d / "run").rename(d / "real-run")
        (d / "run").symlink_to(d / "real-run")
        (d / "real-run" / ".metrics.jsonl.0a1b2c3d.tmp").write_text("stale")
        (d / "real-run" / "checkpoints" / ".last.ckpt.abcdefgh.tmp").write_text("stale")
        (d / "real-run" / "notes.tmp").write_text("mine")

    cases.append(Case("link-symlinked-run-directory-with-stale-temporaries", "link", RESUME, 0, "", "", (
        _outside, symlinked_run_dir), note="the run directory itself may be a link; its stale temporaries go"))
    return cases


# ------------------------------------------------------------------------------------------------- provenance
def _side_effect_modules(d: Path) -> None:
    for name in MARKER_MODULES:
        (d / f"{name}.py").write_text(SIDE_EFFECT)


def _crafted(**changes: Any) -> Builder:
    """A finished run, then ``crafted.ckpt``: its checkpoint with the embedded configuration changed (dotted keys
    set to class paths of side-effect modules)."""
    def build(d: Path) -> None:
        import yaml

        from pl_fedsparse.run.checkpoint import load_checkpoint, save_checkpoint

        state = load_checkpoint(d / "run" / "checkpoints" / "last.ckpt")
        state.pop("loaded_from", None)
        state.pop("format", None)
        cfg = yaml.safe_load(state["config"])
        for key, value in changes.items():
            node = cfg
            parts = key.split("__")
            for p in parts[:-1]:
                node = node.setdefault(p, {})
            node[parts[-1]] = value
        state["config"] = yaml.safe_dump(cfg)
        save_checkpoint(d / "crafted.ckpt", state)
    return build


def _evil(module: str, **init: Any) -> dict[str, Any]:
    return {"class_path": f"{module}.Evil", "init_args": init}


def _provenance_cases() -> list[Case]:
    cases = []
    crafted = (*RESUME[:-1], "crafted.ckpt")

    def add(cid: str, args: tuple[str, ...], code: int, expect: str, *build: Builder, note: str = "") -> None:
        cases.append(Case(cid, "provenance", args, code, expect, "error:", (_side_effect_modules, _finished_run,
                                                                            *build), note=note))

    add("provenance-model", crafted, 2, "model.class_path", _crafted(model=_evil("sidefx", lr=0.01)))
    add("provenance-data", crafted, 2, "data.class_path", _crafted(data=_evil("sidefx_data")))
    add("provenance-callback", crafted, 2, "trainer.callbacks", _crafted(trainer__callbacks=[_evil("sidefx_cb",
                                                                                                     lr=1)]))
    add("provenance-backbone", crafted, 2, "model.backbone.class_path",
        _crafted(model__backbone=_evil("sidefx_backbone", num_classes=3)))
    add("provenance-executor", crafted, 2, "trainer.executor", _crafted(trainer__executor=_evil("sidefx_exec")))
    add("provenance-topology", crafted, 2, "trainer.topology", _crafted(trainer__topology=_evil("sidefx_topology")))
    add("provenance-stdlib-looking-names", crafted, 2, "model.class_path",
        _crafted(model=_evil("json_tools"), data=_evil("os_utils"), trainer__callbacks=[_evil("typing_compat")]))
    add("provenance-the-stdlib-this", crafted, 2, "model.class_path",
        _crafted(model={"class_path": "this.Evil", "init_args": {}}))
    add("provenance-optimizer-as-a-class", crafted, 2, "model.optimizer",
        _crafted(model__optimizer=_evil("sidefx")))

    def run_config(d: Path) -> None:  # the run directory's config.yaml (from elsewhere) names them
        import yaml

        cfg = yaml.safe_load((d / "run" / "config.yaml").read_text())
        cfg["model"] = _evil("sidefx", lr=0.01)
        cfg["trainer"]["callbacks"] = [_evil("sidefx_cb")]
        (d / "run" / "config.yaml").write_text(yaml.safe_dump(cfg))

    def run_json(d: Path) -> None:
        import json

        info = json.loads((d / "run" / "run.json").read_text())
        info.update(model="sidefx.Evil", config={"model": _evil("sidefx")}, callbacks=["sidefx_cb.Evil"])
        (d / "run" / "run.json").write_text(json.dumps(info))

    def both(d: Path) -> None:
        run_config(d)
        run_json(d)
        _crafted(model=_evil("sidefx"), data=_evil("sidefx_data"))(d)

    add("provenance-run-config-yaml", RESUME, 0, "", run_config,
        note="the run's config.yaml (from elsewhere) names them; the resume reads it as text, then replaces it")
    add("provenance-run-json", RESUME, 0, "", run_json, note="run.json (from elsewhere) names them")
    add("provenance-checkpoint-run-json-and-config", crafted, 2, "model.class_path", both)
    add("provenance-test-subcommand", ("test", *crafted[1:]), 0, "", _crafted(model=_evil("sidefx")),
        note="pl-fed test evaluates the configured model with the checkpoint's weights; its class paths stay text")

    def pickled(d: Path) -> None:
        import pickle

        class Payload:
            def __reduce__(self) -> tuple[Any, ...]:
                return (exec, (f"open({str(d / 'sidefx.imported')!r}, 'w').write('ran')",))

        (d / "crafted.ckpt").write_bytes(pickle.dumps({"round": 1, "x": Payload()}))

    add("provenance-pickle-payload", crafted, 2, "ckpt_path='crafted.ckpt' is invalid", pickled,
        note="a checkpoint that would run code when unpickled")
    return cases


CASES: list[Case] = [*_input_cases(), *_link_cases(), *_provenance_cases()]


# ------------------------------------------------------------------------------------------------- running a case
def prepare(case: Case, d: Path) -> None:
    """Write the case's files into the (empty, existing) scratch folder ``d``."""
    for build in case.build:
        build(d)


def digest(path: Path) -> dict[str, tuple[Any, ...]]:
    """Every entry under ``path`` (links not followed): kind, size, modification time and a hash of the content."""
    out: dict[str, tuple[Any, ...]] = {}
    if not os.path.lexists(path):
        return out
    for root, dirs, files in os.walk(path, followlinks=False):
        for name in sorted(dirs + files):
            p = os.path.join(root, name)
            st = os.lstat(p)
            rel = os.path.relpath(p, path)
            if os.path.islink(p):
                out[rel] = ("link", os.readlink(p))
            elif os.path.isdir(p):
                out[rel] = ("dir",)
            else:
                with open(p, "rb") as f:
                    out[rel] = ("file", st.st_size, st.st_mtime_ns, hashlib.sha256(f.read()).hexdigest())
    return out


@dataclass
class Before:
    """What :func:`judge` compares with: the run directory and ``outside/`` before the run."""

    run: dict[str, tuple[Any, ...]]
    run_existed: bool
    outside: dict[str, tuple[Any, ...]]
    zen_loaded: bool
    #: in-process runs: the marker modules (and ``this``) the run left in ``sys.modules`` (then forgotten)
    imported: list[str] = field(default_factory=list)


def snapshot(d: Path) -> Before:
    return Before(digest(d / "run"), os.path.lexists(d / "run"), digest(d / "outside"), "this" in sys.modules)


def judge(case: Case, d: Path, code: int, out: str, err: str, before: Before) -> dict[str, Any]:
    """Check one run of ``case``: a dict of verdicts (``one_line``, ``exit``, ``nothing_written`` (``None`` where the
    case is not a refusal before the run), ``outside_touched`` (link cases), ``markers`` (provenance cases)) and
    ``problems`` (why, in words; empty when the case behaved)."""
    problems: list[str] = []
    lines = [x for x in err.splitlines() if x.strip()]
    if case.code == 0 and case.expect == "":
        one = not lines
        if not one:
            problems.append(f"expected no stderr line, got {len(lines)}: {err.strip()[-400:]}")
    else:
        one = len(lines) == 1 and lines[0].startswith(case.prefix) and case.expect in lines[0]
        if not one:
            problems.append(f"expected one line starting {case.prefix!r} holding {case.expect!r}, got "
                            f"{len(lines)}: {err.strip()[-400:]}")
    if "Traceback" in err:
        one = False
        problems.append("a traceback")
    exit_ok = code == case.code
    if not exit_ok:
        problems.append(f"exit {code} (expected {case.code})")
    written: bool | None = None
    run = d / "run"
    if case.code != 0 and not case.started:
        after = digest(run)
        written = after == before.run and os.path.lexists(run) == before.run_existed
        if not written:
            changed = sorted(set(after.items()) ^ set(before.run.items()))[:4]
            problems.append(f"the run directory changed before the refusal: {changed}")
    elif os.path.isdir(run):
        leftovers = [p for p in (".lock",) if os.path.lexists(run / p)] + \
            [n for sub in (run, run / "checkpoints") if sub.is_dir() and not sub.is_symlink()
             for n in os.listdir(sub) if n.endswith(".tmp") and not _users_tmp(case, n)
             and not os.path.islink(sub / n)]
        if leftovers:
            problems.append(f"left in the run directory: {leftovers}")
    if case.group == "link" and case.code == 0:  # the user's files named like temporaries, and links, all stay
        after = digest(run)
        lost = [k for k, v in before.run.items() if not k.startswith("tensorboard")
                and (v[0] == "link" or _users_tmp(case, os.path.basename(k))) and after.get(k) != v]
        if lost:
            problems.append(f"the user's files in the run directory were removed or changed: {lost}")
    touched = None
    if case.group == "link":
        after_outside = digest(d / "outside")
        touched = sum(1 for k in set(before.outside) | set(after_outside)
                      if before.outside.get(k) != after_outside.get(k))
        if touched:
            problems.append(f"{touched} file(s) outside the run directory touched")
    markers = None
    if case.group == "provenance":
        found = sorted(p.name for p in d.glob("*.imported")) + sorted(p.name for p in d.glob("*.instantiated"))
        found += [f"module {m}" for m in before.imported]
        if ZEN in out or ZEN in err:
            found.append("this printed the Zen of Python")
        markers = len(found)
        if found:
            problems.append(f"imported: {found}")
    return {"id": case.id, "group": case.group, "exit": code, "exit_ok": exit_ok, "one_line": one,
            "nothing_written": written, "outside_touched": touched, "markers": markers,
            "line": lines[0][:200] if len(lines) == 1 else "", "problems": problems}


def _users_tmp(case: Case, name: str) -> bool:
    """The user's own ``*.tmp`` files that a link case plants (they must stay)."""
    return case.group == "link" and name in ("notes.tmp", ".notes.tmp", ".mine.ckpt.tmp",
                                             ".round-000001.ckpt.short.tmp", ".last.ckpt.0a1b2c3d.tmp.bak")


def run_in_process(case: Case, d: Path) -> tuple[int, str, str, Before]:
    """Prepare ``case`` in ``d`` and run it through :func:`pl_fedsparse.cli.main` in this process (working directory
    ``d``, ``PL_FEDSPARSE_CACHE`` inside it): ``(exit status, stdout, stderr, before)``. Modules the case's files
    define are forgotten afterwards (the next case's folder has its own)."""
    from pl_fedsparse.cli import main

    prepare(case, d)
    before = snapshot(d)
    out, err = io.StringIO(), io.StringIO()
    old_cache = os.environ.get("PL_FEDSPARSE_CACHE")
    os.environ["PL_FEDSPARSE_CACHE"] = str(d / "cache")
    # warnings reach stderr as on the console (Python's last-resort handler prints the bare message), also where a
    # test framework has put handlers of its own on the root logger
    console = logging.StreamHandler(err)
    console.setLevel(logging.WARNING)
    logging.getLogger().addHandler(console)
    try:
        with _cwd(d), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(case.args))
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except Exception:  # noqa: BLE001 - what the console would print: a traceback
                import traceback

                traceback.print_exc()
                code = 1
    finally:
        logging.getLogger().removeHandler(console)
        if old_cache is None:
            os.environ.pop("PL_FEDSPARSE_CACHE", None)
        else:
            os.environ["PL_FEDSPARSE_CACHE"] = old_cache
        before.imported = [m for m in (*MARKER_MODULES, "this") if m in sys.modules
                           and not (m == "this" and before.zen_loaded)]
        for name in ("usermods", "brokenmods", "raisingmods", *MARKER_MODULES):
            sys.modules.pop(name, None)
    return code, out.getvalue(), err.getvalue(), before
