"""torchvision datasets without network: the error names where torchvision looks and which files it wants, and the
MNIST-family files as distributed (``.gz``, e.g. Debian's ``dataset-fashion-mnist``) work as they are."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
from conftest import one_line, run_main

FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def _idx(n: int, images: bool, seed: int) -> bytes:
    """A tiny file in the IDX format torchvision reads (magic, sizes, then the bytes)."""
    rng = np.random.default_rng(seed)
    if images:
        return struct.pack(">IIII", 0x803, n, 28, 28) + rng.integers(0, 256, (n, 28, 28), dtype=np.uint8).tobytes()
    return struct.pack(">II", 0x801, n) + (np.arange(n) % 10).astype(np.uint8).tobytes()


def _write(raw: Path, packed: bool) -> None:
    raw.mkdir(parents=True)
    for i, name in enumerate(FILES):
        data = _idx(60 if name.startswith("train") else 20, "images" in name, i)
        if packed:
            (raw / f"{name}.gz").write_bytes(gzip.compress(data))
        else:
            (raw / name).write_bytes(data)


def _fit(root: Path, run: Path) -> list[str]:
    return ["fit", "--seed_everything", "0", "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar",
            "false", "--trainer.num_rounds", "1", "--model.backbone", "pl_fedsparse.models.MLP",
            "--model.backbone.init_args.num_classes", "10", "--model.backbone.init_args.in_channels", "1",
            "--model.backbone.init_args.input_size", "28", "--data.name", "torchvision", "--data.torchvision_class",
            "FashionMNIST", "--data.root", str(root), "--data.num_clients", "2", "--data.batch_size", "16",
            "--trainer.default_root_dir", str(run)]


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PL_FEDSPARSE_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize("packed", [True, False], ids=["gz-as-distributed", "uncompressed"])
def test_the_files_work_compressed_or_not(tmp_path: Path, packed: bool, capsys: pytest.CaptureFixture[str]) -> None:
    _write(tmp_path / "fmnist" / "FashionMNIST" / "raw", packed)
    code, _, err = run_main(_fit(tmp_path / "fmnist", tmp_path / "run"), capsys)
    assert code == 0, err
    assert (tmp_path / "run" / "metrics.jsonl").is_file()


def test_a_missing_copy_names_the_layout_and_the_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "fmnist").mkdir()
    code, _, err = run_main(_fit(tmp_path / "fmnist", tmp_path / "run"), capsys)
    assert code == 2
    line = one_line(err)
    raw = tmp_path / "fmnist" / "FashionMNIST" / "raw"
    assert f"FashionMNIST reads {raw}/ holding train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz" in line
    assert "the files as distributed, .gz, or uncompressed" in line
