"""The user's data is checked before round 0: arrays of one length, finite features, class folders with images, and
every client with training and evaluation data — or the run says which clients lack what, and the rows say how many
clients the client metrics average."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
from conftest import one_line, run_main


def _table(path: Path, **arrays: np.ndarray) -> None:
    np.savez(path, **arrays)


def _fit(root: Path, run: Path, *extra: str) -> list[str]:
    return ["fit", "--seed_everything", "0", "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar",
            "false", "--trainer.num_rounds", "1", "--model.backbone", "pl_fedsparse.models.MLP",
            "--model.backbone.init_args.num_classes", "3", "--model.backbone.init_args.in_features", "5",
            "--data.name", "tensors", "--data.root", str(root), "--data.partition", "natural",
            "--data.num_clients", "null", "--data.batch_size", "8", "--trainer.default_root_dir", str(run), *extra]


def _arrays(n: int = 120, clients: int = 4) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 5)).astype(np.float32)
    return {"x": x, "y": (np.arange(n) % 3), "client": np.arange(n) % clients}


def test_client_ids_shorter_than_the_samples_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _arrays()
    _table(tmp_path / "t.npz", x=a["x"], y=a["y"], client=a["client"][:80])
    code, _, err = run_main(_fit(tmp_path / "t.npz", tmp_path / "run"), capsys)
    assert code == 2
    assert "one client id per sample: client of length 80 and x, y of length 120" in one_line(err)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_features_are_refused_naming_the_row(tmp_path: Path, bad: float,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    a = _arrays()
    a["x"][[7, 50], 2] = bad
    _table(tmp_path / "t.npz", train_x=a["x"], train_y=a["y"], test_x=a["x"][:30], test_y=a["y"][:30])
    code, _, err = run_main(_fit(tmp_path / "t.npz", tmp_path / "run", "--data.partition", "iid",
                                 "--data.num_clients", "3"), capsys)
    assert code == 2
    assert "returned train_x with non-finite values (NaN or inf) in 2 row(s), the first row 7" in one_line(err)
    assert not (tmp_path / "run").exists()


def test_clients_without_test_rows_are_named_and_counted(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         caplog: pytest.LogCaptureFixture) -> None:
    a = _arrays()
    train_client = np.arange(120) % 4  # clients 0-3 train; the test rows belong to clients 0-2 only
    _table(tmp_path / "t.npz", train_x=a["x"], train_y=a["y"], train_client=train_client, test_x=a["x"][:30],
           test_y=a["y"][:30], test_client=np.arange(30) % 3)
    with caplog.at_level(logging.WARNING):
        code, _, err = run_main(_fit(tmp_path / "t.npz", tmp_path / "run", "--data.test_mode", "partition"), capsys)
    assert code == 0, err
    assert "have no test sample: acc_mean and the other client metrics average the 3 clients" in caplog.text
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["eval_clients"] == 3


def test_a_run_where_every_client_lacks_test_data_is_refused(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    a = _arrays(n=4)
    _table(tmp_path / "t.npz", **a)  # one sample per client: nothing is held out
    code, _, err = run_main(_fit(tmp_path / "t.npz", tmp_path / "run"), capsys)
    assert code == 2
    assert "returned no test split (0 samples): expected at least one test sample" in one_line(err)
    assert not (tmp_path / "run").exists()


def test_an_empty_class_folder_is_named(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from PIL import Image

    from pl_fedsparse.data.sources.image_folder import _load_folder

    for c in ("cat", "dog"):
        (tmp_path / "imgs" / c).mkdir(parents=True)
        for i in range(4):
            Image.new("RGB", (8, 8), (i * 40, 0, 0)).save(tmp_path / "imgs" / c / f"{i}.png")
    (tmp_path / "imgs" / "emu").mkdir()
    with caplog.at_level(logging.WARNING):
        base = _load_folder(str(tmp_path / "imgs"), 0.25, 0, None)
    assert base.num_classes == 3
    assert "class folder(s) 'emu' hold no image" in caplog.text


def test_a_natural_partition_records_which_of_the_users_ids_each_client_is(tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    a = _arrays()
    a["client"] = np.array([34, 3, 21, 8])[np.arange(120) % 4]  # the data's own ids, in no order
    _table(tmp_path / "t.npz", **a)
    code, _, err = run_main(_fit(tmp_path / "t.npz", tmp_path / "run"), capsys)
    assert code == 0, err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["client_ids"] == [3, 8, 21, 34]  # client i is the i-th smallest id
    assert len(summary["client_acc"]) == 4
