"""benchmarks/peers: the peers' LeNet is pl_fedsparse's, the exported split is the data module's, the driver parses."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))

from common import LeNet  # noqa: E402

from pl_fedsparse.models import LeNetCIFAR  # noqa: E402


def test_the_peers_lenet_is_lenet_cifar_layer_by_layer() -> None:
    ours, theirs = LeNetCIFAR(num_classes=10), LeNet()
    assert [(n, t.shape) for n, t in ours.state_dict().items()] == [(n, t.shape) for n, t in
                                                                    theirs.state_dict().items()]
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(4, 3, 32, 32)
    assert torch.equal(ours(x), theirs(x))  # the same forward, not only the same shapes


def test_the_exported_split_is_the_data_modules(tmp_path: Path) -> None:
    import run  # benchmarks/peers/run.py

    from pl_fedsparse.data import FederatedDataModule

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("model:\n  backbone: {class_path: pl_fedsparse.models.LeNetCIFAR}\n"
                   "data:\n  name: synthetic\n  num_clients: 3\n  partition: iid\n  test_mode: split\n"
                   "  split_ratios: [0.75, 0.0, 0.25]\n  synthetic: {num_train: 120, channels: 3, size: 32}\n")
    info = run.export_split(cfg, "unused", tmp_path)
    dm = FederatedDataModule(name="synthetic", num_clients=3, partition="iid", test_mode="split",
                             split_ratios=[0.75, 0.0, 0.25], synthetic={"num_train": 120, "channels": 3, "size": 32})
    dm.setup()
    for k in range(3):
        for part in ("train", "test"):
            d = np.load(tmp_path / "dataset" / run.DATASET / part / f"{k}.npz", allow_pickle=True)["data"].tolist()
            x, y = (torch.cat(t) for t in zip(*dm.eval_loader(k, split=part), strict=True))
            assert np.array_equal(d["x"], x.numpy()) and np.array_equal(d["y"], y.numpy())
        assert info["train"][k] == dm.num_samples(k, "train")


@pytest.mark.parametrize("bad", [["--rounds", "1"], ["--only", "fedml"]])
def test_the_driver_refuses_bad_arguments_in_one_line(bad: list[str]) -> None:
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "peers" / "run.py"), "--data-root", "x", *bad],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("run.py: error:")
