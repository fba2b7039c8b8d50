"""A researcher's own project, outside the repository: their LightningModule, their data, their callback and YAML.

A scratch project is written into a temporary directory with its own ``models/``, ``data/``, ``callbacks/`` and
configs, and run from there exactly as a user would (``pl-fed fit --config my.yaml``): in process, on 2 Ray workers
(identical metrics at one thread each) and after a kill + resume (identical metrics). The module does not subclass
``FederatedModule``; the callback is the user's own; the data come through the public data hooks.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from conftest import run_main

REPO = Path(__file__).resolve().parents[1]
#: metrics that may differ between two runs of the same federation (times, executor retries)
IGNORED = ("time_s", "time_cum_s", "time_train_s", "worker_retries")

MODEL = '''
"""A user's LightningModule: no pl_fedsparse base class, its own loss and optimiser."""
import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F


class TinyNet(pl.LightningModule):
    def __init__(self, num_classes: int = 4, in_features: int = 64, hidden: int = 32, lr: float = 0.1) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU(),
                                 nn.Linear(hidden, num_classes))
        self.lr = lr

    def forward(self, x):
        return self.net(x.float())

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.5)
'''

CALLBACK = '''
"""A user's method: counts every client's training fits as client state and reports their mean."""
import torch

from pl_fedsparse import FederatedCallback


class CountFits(FederatedCallback):
    def setup_federation(self, loop):
        self.add_client_state(loop, "fits", lambda k: torch.zeros((), dtype=torch.long))

    def on_client_fit_end(self, loop, module, update):
        if update.kind == "train":
            k = update.client_idx
            self.set_client_state(loop, k, "fits", self.get_client_state(loop, k, "fits") + 1)

    def on_round_end(self, loop, round_idx, metrics):
        fits = [int(self.get_client_state(loop, k, "fits")) for k in range(loop.num_clients)]
        metrics["mean_fits"] = sum(fits) / len(fits)
'''

TRAINER = {"accelerator": "cpu", "enable_progress_bar": False, "logger": False, "join_ratio": 0.5,
           "eval_every": 1}
TINY = {"num_train": 400, "num_test": 100, "size": 8, "channels": 1, "num_classes": 4}


def _config(callbacks: list[dict[str, Any]], data: dict[str, Any], model: dict[str, Any], rounds: int = 3
            ) -> dict[str, Any]:
    return {"seed_everything": 0, "trainer": {**TRAINER, "num_rounds": rounds, "callbacks": callbacks},
            "model": model, "data": data}


USER_MODEL = {"class_path": "models.tiny.TinyNet", "init_args": {"num_classes": 4, "in_features": 64}}
SYNTH_DATA = {"name": "synthetic", "num_clients": 6, "alpha": 0.5, "batch_size": 16, "synthetic": TINY}
COUNT = {"class_path": "callbacks.count_fits.CountFits"}

#: (b) the project's own image folder, 3 classes, read by name (data/images/<train|test>/<class>/*.png)
IMAGE_DATA = {"name": "image_folder", "root": "data/images", "num_clients": 5, "partition": "dirichlet",
              "alpha": 0.5, "batch_size": 16}
#: (c) the project's own tabular tensors (20 features) with natural client ids (data/table.npz)
TABLE_DATA = {"name": "tensors", "root": "data/table.npz", "partition": "natural", "num_clients": None,
              "test_mode": "split", "batch_size": 16}

#: scenario -> config (written as the scratch project's <scenario>.yaml)
SCENARIOS: dict[str, dict[str, Any]] = {
    "fedavg_ft": _config([{"class_path": "pl_fedsparse.callbacks.FineTune", "init_args": {"epochs": 1}}, COUNT],
                         SYNTH_DATA, USER_MODEL),
    "fedspa": _config([{"class_path": "pl_fedsparse.callbacks.GradientRegrow",
                        "init_args": {"density": 0.5, "alpha0": 0.5}},
                       {"class_path": "pl_fedsparse.callbacks.FedSpaAggregation"}, COUNT],
                      SYNTH_DATA, USER_MODEL),
    "images": _config([{"class_path": "pl_fedsparse.callbacks.FineTune", "init_args": {"epochs": 1}}, COUNT],
                      IMAGE_DATA, {"class_path": "models.tiny.TinyNet",
                                   "init_args": {"num_classes": 3, "in_features": 3 * 8 * 8}}),
    "table_ditto": _config([{"class_path": "pl_fedsparse.callbacks.Ditto", "init_args": {"lam": 0.1}}, COUNT],
                           TABLE_DATA, {"class_path": "models.tiny.TinyNet",
                                        "init_args": {"num_classes": 3, "in_features": 20}}),
}
SCENARIOS["table_ditto"]["trainer"]["local_epochs"] = 4  # 48 samples per client: 3 steps an epoch


def write_images(root: Path, classes: int = 3, train: int = 40, test: int = 12, size: int = 8) -> None:
    """PNG files ``root/<split>/<class>/<i>.png``: class ``c`` is a noisy colour of its own."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in (("train", train), ("test", test)):
        for c in range(classes):
            folder = root / split / f"class_{'abc'[c]}"
            folder.mkdir(parents=True)
            for i in range(n):
                colour = np.zeros(3)
                colour[c] = 200
                pixels = np.clip(colour + rng.normal(0, 60, (size, size, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.png")


def write_table(path: Path, clients: int = 6, per_client: int = 60, features: int = 20) -> None:
    """``x`` [N, 20] float32, ``y`` in {0, 1, 2} from a linear rule, ``client`` ids with a skewed label mix."""
    rng = np.random.default_rng(1)
    w = rng.normal(size=(features, 3))
    xs, ys, ids = [], [], []
    for k in range(clients):
        x = rng.normal(size=(per_client, features)).astype(np.float32) + rng.normal(0, 0.5, features)
        xs.append(x)
        ys.append((x @ w).argmax(1))
        ids.append(np.full(per_client, 10 + 3 * k))  # ids need not be 0..K-1
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, x=np.concatenate(xs), y=np.concatenate(ys), client=np.concatenate(ids))


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The scratch project: ``models/``, ``callbacks/``, ``data/`` and one YAML per scenario, outside the repo."""
    root = tmp_path_factory.mktemp("my_project")
    assert REPO not in root.parents
    for pkg, files in {"models": {"tiny.py": MODEL}, "callbacks": {"count_fits.py": CALLBACK}}.items():
        (root / pkg).mkdir()
        (root / pkg / "__init__.py").write_text("")
        for name, text in files.items():
            (root / pkg / name).write_text(textwrap.dedent(text))
    write_images(root / "data" / "images")
    write_table(root / "data" / "table.npz")
    for name, cfg in SCENARIOS.items():
        (root / f"{name}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return root


def _rows(run: Path) -> list[dict[str, Any]]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in IGNORED} for r in rows]


def _fit(project: Path, name: str, run: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> list[dict]:
    """``pl-fed fit --config <name>.yaml`` run from the project directory (in this process, on one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with in_project(project):
            code, _, err = run_main(["fit", "--config", f"{name}.yaml", "--trainer.default_root_dir", str(run),
                                     *extra], capsys)
    finally:
        torch.set_num_threads(threads)
    assert code == 0, err
    return _rows(run)


#: the scratch project's top-level packages
PACKAGES = ("models", "callbacks", "mydata")


@contextlib.contextmanager
def in_project(project: Path) -> Iterator[None]:
    """Work in ``project`` as ``pl-fed`` run there would: its directory is the working directory, and its top-level
    packages are not shadowed by modules of the same name that other tests imported (the repository's own
    ``callbacks/`` examples)."""
    cwd, path = os.getcwd(), list(sys.path)
    saved = {k: sys.modules.pop(k) for k in list(sys.modules) if k.split(".")[0] in PACKAGES}
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO]
    os.chdir(project)
    try:
        yield
    finally:
        os.chdir(cwd)
        sys.path[:] = path
        for k in [k for k in sys.modules if k.split(".")[0] in PACKAGES]:
            del sys.modules[k]
        sys.modules.update(saved)


@pytest.fixture(scope="module")
def reference(project: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, list[dict]]]:
    """Each scenario's uninterrupted in-process run (computed once, on first use)."""
    cache: dict[str, list[dict]] = {}

    class Lazy(dict):
        def __missing__(self, name: str) -> list[dict]:
            run = tmp_path_factory.mktemp(f"ref_{name}")
            shutil.rmtree(run)
            capsys = _NoCapsys()
            rows = _fit(project, name, run, capsys)  # type: ignore[arg-type]
            cache[name] = rows
            return rows

    yield Lazy()


class _NoCapsys:
    """``run_main`` reads the captured output; module-scoped fixtures have no capsys: a stand-in."""

    def readouterr(self) -> Any:
        class Out:
            out, err = "", ""

        return Out()


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_runs_in_process_from_the_project(project: Path, name: str, reference: dict[str, list[dict]]) -> None:
    rows = reference[name]
    chance = 1 / 4 if name in ("fedavg_ft", "fedspa") else 1 / 3
    assert len(rows) == 3 and rows[-1]["acc_mean"] > chance + 0.05  # learns something
    assert rows[-1]["mean_fits"] > 0  # the user's callback ran and its client state persisted
    if name == "fedspa":  # masks on the user's parameter names: sparse messages
        dense = sum(p.numel() for p in torch.nn.Linear(64, 32).parameters()) + 32 * 4 + 4
        assert rows[0]["comm_bytes_up"] < 0.8 * 3 * 4 * dense


@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.slow
def test_two_ray_workers_give_the_in_process_metrics(project: Path, name: str, tmp_path: Path,
                                                     reference: dict[str, list[dict]],
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("ray")
    executor = json.dumps({"class_path": "pl_fedsparse.executors.RayExecutor",
                           "init_args": {"num_workers": 2, "num_cpus_per_worker": 1}})
    rows = _fit(project, name, tmp_path / "ray", capsys, "--trainer.executor", executor)
    assert rows == reference[name]


@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.slow
def test_kill_and_resume_with_the_console_script(project: Path, name: str, tmp_path: Path,
                                                 reference: dict[str, list[dict]]) -> None:
    """The real ``pl-fed`` in the project directory, SIGKILLed once round 1's checkpoint exists, then resumed with
    the README's command: the same metrics as the uninterrupted run."""
    exe = shutil.which("pl-fed") or str(Path(sys.executable).with_name("pl-fed"))
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    fit = [exe, "fit", "--config", f"{name}.yaml", "--trainer.default_root_dir", str(run)]
    proc = subprocess.Popen(fit, cwd=project, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (run / "checkpoints" / "round-000001.ckpt").exists():
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "no round-1 checkpoint after 120 s"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL  # killed mid-run, not finished
    resume = [exe, "fit", "--config", str(run / "config.yaml"), "--trainer.default_root_dir", str(run),
              "--ckpt_path", str(run / "checkpoints" / "last.ckpt")]
    done = subprocess.run(resume, cwd=project, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert _rows(run) == reference[name]


def test_a_module_without_training_step_is_refused_in_one_line(project: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    (project / "models" / "broken.py").write_text(textwrap.dedent('''
        import lightning.pytorch as pl
        from torch import nn


        class NoStep(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = nn.Linear(64, 4)

            def forward(self, x):
                return self.net(x.flatten(1))
        '''))
    with in_project(project):
        code, _, err = run_main(["fit", "--config", "fedavg_ft.yaml", "--model", "models.broken.NoStep",
                                 "--trainer.default_root_dir", str(tmp_path / "r")], capsys)
    assert code == 2
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and "model=NoStep is invalid" in lines[0] and "training_step" in lines[0], err
    assert not (tmp_path / "r").exists()  # refused before anything was written


def test_the_engine_measures_loss_and_samples_of_a_module_without_fit_metrics(project: Path,
                                                                              reference: dict[str, list[dict]]
                                                                              ) -> None:
    rows = reference["fedavg_ft"]
    assert all(np.isfinite(r["train_loss"]) for r in rows)
    assert rows[-1]["flops_train_cum"] > 0
