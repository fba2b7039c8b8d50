"""Base datasets (synthetic, IDX, image folders, caches), the tensor loader and the federated datamodule.

Real-data tests skip when the files are missing: Fashion-MNIST needs ``apt-get install -y dataset-fashion-mnist``,
CIFAR-10 the JPEG tarball (``$PL_FEDSPARSE_CIFAR_TAR``, default ``/work/shared/data/cifar10-jpg.tar.gz``) or an
extracted copy (``$PL_FEDSPARSE_CIFAR_ROOT``); decoding all 60k CIFAR images runs only with
``PL_FEDSPARSE_REAL_DATA=1``.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import struct
import tarfile
import time
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from torchvision.io import encode_jpeg, write_png

import pl_fedsparse.data.datasets as ds
import pl_fedsparse.data.sources._builtin as builtin_sources
from pl_fedsparse.data import FederatedDataModule, TensorBatchLoader, load_dataset, normalize, read_idx
from pl_fedsparse.errors import ConfigError, DataNotFoundError

TINY = {"num_train": 400, "num_test": 100, "size": 8, "channels": 1, "num_classes": 4}
CIFAR_TAR = Path(os.environ.get("PL_FEDSPARSE_CIFAR_TAR", "/work/shared/data/cifar10-jpg.tar.gz"))
FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
CIFAR_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own empty decode cache and a clean in-process memo."""
    cache = tmp_path / "cache"
    monkeypatch.setenv(ds.CACHE_ENV, str(cache))
    ds.clear_memo()
    yield cache
    ds.clear_memo()


def idx_bytes(array: np.ndarray) -> bytes:
    assert array.dtype == np.uint8
    return bytes([0, 0, 8, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()


def write_idx_set(folder: Path, n_train: int = 30, n_test: int = 10, gz: bool = True, prefix: str = "") -> None:
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("t10k", n_test)):
        for kind, arr in (("images-idx3", rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)),
                          ("labels-idx1", (np.arange(n) % 10).astype(np.uint8))):
            name = f"{prefix}{split}-{kind}-ubyte"
            data = idx_bytes(arr)
            if gz:
                (folder / (name + ".gz")).write_bytes(gzip.compress(data))
            else:
                (folder / name).write_bytes(data)


def write_image_folder(root: Path, per_class: tuple[int, int] = (3, 1), jpeg: bool = False, size: int = 8) -> None:
    gen = torch.Generator().manual_seed(0)
    for split, n in zip(("train", "test"), per_class):
        for c, cls in enumerate(CIFAR_CLASSES):
            (root / split / cls).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                img = torch.randint(0, 256, (3, size, size), dtype=torch.uint8, generator=gen)
                img[0] = c * 20  # class-dependent, lossless-checkable red channel for PNGs
                if jpeg:  # flat colours survive JPEG's chroma subsampling
                    img[:] = torch.tensor([c * 20, 100, 50], dtype=torch.uint8).view(3, 1, 1)
                    (root / split / cls / f"{i:04d}.jpg").write_bytes(encode_jpeg(img, quality=95).numpy().tobytes())
                else:
                    write_png(img, str(root / split / cls / f"{i:04d}.png"))


# ------------------------------------------------------------------------------------------- base datasets


def test_synthetic_deterministic_fast_and_shaped() -> None:
    d = load_dataset("synthetic")
    assert d.train_x.shape == (6000, 3, 16, 16) and d.train_x.dtype == torch.uint8
    assert d.test_x.shape == (1000, 3, 16, 16) and d.train_y.dtype == torch.int64
    assert d.num_classes == 10 and len(d.mean) == 3 and min(d.std) > 0
    assert load_dataset("synthetic") is d  # in-process memo
    ds.clear_memo()
    t = time.perf_counter()
    again = load_dataset("synthetic")
    assert time.perf_counter() - t < 1.0  # generation is fast (timed warm, after the first call's imports)
    assert again is not d and torch.equal(again.train_x, d.train_x) and torch.equal(again.test_y, d.test_y)
    other = load_dataset("synthetic", synthetic={"seed": 1})
    assert not torch.equal(other.train_x, d.train_x)


def test_synthetic_is_learnable_but_not_trivial() -> None:
    """Nearest-class-mean accuracy (a proxy for a briefly trained model) is far above chance and below 100 %."""
    d = load_dataset("synthetic")
    x = d.train_x.float().flatten(1)
    means = torch.stack([x[d.train_y == c].mean(0) for c in range(10)])
    acc = (torch.cdist(d.test_x.float().flatten(1), means).argmin(1) == d.test_y).float().mean().item()
    assert 0.4 < acc < 0.97


def test_bad_names_and_params() -> None:
    with pytest.raises(ConfigError, match=r"^data\.name='foo' is invalid: expected one of synthetic, cifar10, "):
        load_dataset("foo")
    with pytest.raises(ConfigError, match=r"^data\.synthetic\.colour=1 is invalid"):
        load_dataset("synthetic", synthetic={"colour": 1})
    with pytest.raises(ConfigError, match=r"^data\.synthetic\.num_classes=1 is invalid: expected an int >= 2"):
        load_dataset("synthetic", synthetic={"num_classes": 1})
    with pytest.raises(ConfigError, match=r"^data\.emnist_split='x' is invalid"):
        load_dataset("emnist", "/nonexistent", emnist_split="x")


def test_missing_data_says_how_to_get_it(tmp_path: Path) -> None:
    with pytest.raises(DataNotFoundError, match=r"^data\.root='.*' has no CIFAR-10: pass --data\.download true.*"
                                                r"tar -xzf cifar10-jpg\.tar\.gz") as err:
        load_dataset("cifar10", str(tmp_path / "nowhere"), download=False)
    assert "\n" not in str(err.value)
    with pytest.raises(DataNotFoundError, match=r"apt-get install -y dataset-fashion-mnist.*/usr/share/datasets"):
        load_dataset("fashion_mnist", str(tmp_path))
    with pytest.raises(DataNotFoundError, match=r"^data\.root=None has no MNIST \(.*\): the download into "):
        load_dataset("mnist")


@pytest.mark.parametrize("gz", [True, False])
def test_read_idx(tmp_path: Path, gz: bool) -> None:
    arr = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    path = tmp_path / ("a-idx3-ubyte" + (".gz" if gz else ""))
    path.write_bytes(gzip.compress(idx_bytes(arr)) if gz else idx_bytes(arr))
    out = read_idx(path)
    assert out.dtype == torch.uint8 and out.tolist() == arr.tolist()


def test_read_idx_corrupted(tmp_path: Path) -> None:
    data = idx_bytes(np.zeros((5, 28, 28), dtype=np.uint8))
    truncated_gz = tmp_path / "train-images-idx3-ubyte.gz"
    truncated_gz.write_bytes(gzip.compress(data)[:-30])
    with pytest.raises(ConfigError, match=r"^data\.root=.* IDX file .*train-images-idx3-ubyte\.gz is corrupted"):
        read_idx(truncated_gz)
    short = tmp_path / "short-idx3-ubyte"
    short.write_bytes(data[:-10])
    with pytest.raises(ConfigError, match=r"short-idx3-ubyte is corrupted \(.*expected 3936"):
        read_idx(short)
    magic = tmp_path / "magic-idx3-ubyte"
    magic.write_bytes(b"\x01\x02" + data[2:])
    with pytest.raises(ConfigError, match=r"bad magic number"):
        read_idx(magic)
    # a corrupted file inside a dataset folder fails with the same one line
    write_idx_set(tmp_path / "fm")
    (tmp_path / "fm" / "t10k-labels-idx1-ubyte.gz").write_bytes(b"\x1f\x8b garbage")
    with pytest.raises(ConfigError, match=r"t10k-labels-idx1-ubyte\.gz is corrupted"):
        load_dataset("fashion_mnist", str(tmp_path / "fm"))


@pytest.mark.parametrize("layout", ["flat_gz", "flat_raw", "torchvision"])
def test_idx_dataset_layouts_and_cache(tmp_path: Path, isolated_cache: Path, layout: str) -> None:
    root = tmp_path / "mnist"
    folder = root / "MNIST" / "raw" if layout == "torchvision" else root
    write_idx_set(folder, gz=layout != "flat_raw")
    d = load_dataset("mnist", str(root))
    assert d.train_x.shape == (30, 1, 28, 28) and d.test_x.shape == (10, 1, 28, 28)
    assert d.train_y.tolist() == [i % 10 for i in range(30)] and d.num_classes == 10
    assert len(list(isolated_cache.glob("mnist-*.pt"))) == 1
    ds.clear_memo()
    assert torch.equal(load_dataset("mnist", str(root)).train_x, d.train_x)


def test_emnist_letters_shifted(tmp_path: Path) -> None:
    write_idx_set(tmp_path, prefix="emnist-letters-")
    for f in tmp_path.glob("*labels*"):  # letters labels are 1..26 in the files
        f.write_bytes(gzip.compress(idx_bytes((np.arange(30 if "train" in f.name else 10) % 26 + 1)
                                              .astype(np.uint8))))
    d = load_dataset("emnist", str(tmp_path), emnist_split="letters")
    assert d.num_classes == 26 and int(d.train_y.min()) == 0 and int(d.train_y.max()) == 25


@pytest.mark.parametrize("nested", [False, True])
def test_image_folder_and_cache_reuse(tmp_path: Path, isolated_cache: Path, monkeypatch: pytest.MonkeyPatch,
                                      nested: bool) -> None:
    root = tmp_path / "cifar"
    write_image_folder(root / "cifar10-jpg" if nested else root)
    d = load_dataset("cifar10", str(root))
    assert d.train_x.shape == (30, 3, 8, 8) and d.test_x.shape == (10, 3, 8, 8)
    assert d.train_y.tolist() == [c for c in range(10) for _ in range(3)]
    assert d.train_x[:, 0, 0, 0].tolist() == [c * 20 for c in range(10) for _ in range(3)]  # sorted class order
    caches = list(isolated_cache.glob("cifar10-*.pt"))
    assert len(caches) == 1
    ds.clear_memo()

    def no_decode(*args, **kwargs):
        raise AssertionError("decoded again instead of using the cache")

    monkeypatch.setattr(builtin_sources, "_decode_files", no_decode)
    assert torch.equal(load_dataset("cifar10", str(root)).train_x, d.train_x)
    monkeypatch.undo()
    monkeypatch.setenv(ds.CACHE_ENV, str(isolated_cache))
    caches[0].write_bytes(b"not a torch file")  # a corrupted cache is ignored and rebuilt
    ds.clear_memo()
    assert torch.equal(load_dataset("cifar10", str(root)).train_x, d.train_x)
    assert torch.load(caches[0], weights_only=True)["train_x"].shape == (30, 3, 8, 8)


def test_image_folder_jpeg_and_errors(tmp_path: Path) -> None:
    write_image_folder(tmp_path / "jpg", jpeg=True)
    d = load_dataset("cifar10", str(tmp_path / "jpg"))
    assert d.train_x.shape == (30, 3, 8, 8)
    assert (d.train_x[:, 0].float().mean(dim=(1, 2)) - torch.tensor([c * 20.0 for c in range(10)]).repeat_interleave(3)
            ).abs().max() < 8
    write_image_folder(tmp_path / "bad", per_class=(2, 1))
    (tmp_path / "bad" / "train" / "cat" / "0000.png").write_bytes(b"\x89PNG broken")
    with pytest.raises(ConfigError, match=r"^data\.root=.* image .*cat/0000\.png cannot be decoded"):
        load_dataset("cifar10", str(tmp_path / "bad"))
    assert "decode_png.cpp" not in str(load_error(tmp_path / "bad"))  # torchvision's source file is not the user's


def load_error(root: Path) -> ConfigError:
    with pytest.raises(ConfigError) as refused:
        load_dataset("cifar10", str(root))
    return refused.value


@pytest.mark.parametrize(("damage", "expected"), [
    (lambda b: b[:len(b) // 2], r"cannot be decoded \(PNG data cut off in chunk IDAT \(the file is truncated\)\)"),
    (lambda b: b[:41] + bytes([b[41] ^ 0xFF]) + b[42:], r"cannot be decoded \(PNG chunk IDAT is damaged \(CRC mismatch\)\)"),
    (lambda b: b[:37] + b"ID\0T" + b[41:], r"cannot be decoded \(PNG chunk 2 has no valid type \(b'ID\\x00T'\)\)"),
])
def test_a_damaged_png_is_named_in_one_line_without_libpng_s_own(tmp_path: Path, capfd: pytest.CaptureFixture[str],
                                                                 damage: Any, expected: str) -> None:
    """A truncated PNG, a flipped byte or a damaged chunk type: one ConfigError naming the file and the damage, and
    nothing on the process's stderr (libpng prints ``libpng error: ...`` there itself when it meets one)."""
    write_image_folder(tmp_path / "bad", per_class=(2, 1))
    png = tmp_path / "bad" / "train" / "cat" / "0000.png"
    png.write_bytes(damage(png.read_bytes()))
    assert re.search(r"image .*cat/0000\.png " + expected, str(load_error(tmp_path / "bad")))
    assert capfd.readouterr().err == ""


def test_image_folder_too_few_classes(tmp_path: Path) -> None:
    write_image_folder(tmp_path / "few", per_class=(1, 1))
    for cls in CIFAR_CLASSES[5:]:
        for split in ("train", "test"):
            for f in (tmp_path / "few" / split / cls).iterdir():
                f.unlink()
            (tmp_path / "few" / split / cls).rmdir()
    with pytest.raises(ConfigError, match=r"^data\.root=.* is invalid: expected 10 class folders"):
        load_dataset("cifar10", str(tmp_path / "few"))


# ------------------------------------------------------------------------------------------- downloads
class FakeTorchvision:
    """Stands in for a torchvision dataset class: records every construction; ``download=True`` "downloads" (writes
    the folder a real download leaves) unless ``offline``, which fails like urllib without network; ``corrupt``: the
    local copy fails torchvision's integrity check."""

    base_folder = "cifar-10-batches-py"
    offline = False
    corrupt = False
    calls: ClassVar[list[tuple[str, bool, bool]]] = []

    def __init__(self, root: str, train: bool = True, download: bool = False, **kwargs: object) -> None:
        type(self).calls.append((str(root), train, download))
        if download:
            if type(self).offline:
                import urllib.error

                raise urllib.error.URLError("[Errno -2] Name or service not known")
            (Path(root) / self.base_folder).mkdir(parents=True, exist_ok=True)
        elif type(self).corrupt or not (Path(root) / self.base_folder).is_dir():
            raise RuntimeError("Dataset not found or corrupted. You can use download=True to download it")
        n = 20 if train else 10
        self.data = np.full((n, 32, 32, 3), 7 if train else 9, dtype=np.uint8)  # NHWC like CIFAR
        self.targets = [i % 10 for i in range(n)]


@pytest.fixture
def fake_cifar(monkeypatch: pytest.MonkeyPatch) -> type[FakeTorchvision]:
    import torchvision

    fake = type("FakeCIFAR10", (FakeTorchvision,), {"calls": [], "offline": False, "corrupt": False})
    monkeypatch.setattr(torchvision.datasets, "CIFAR10", fake)
    return fake


def test_local_copy_wins_over_download(tmp_path: Path, fake_cifar: type[FakeTorchvision]) -> None:
    (tmp_path / "tv" / fake_cifar.base_folder).mkdir(parents=True)  # torchvision's layout: read, never downloaded
    d = load_dataset("cifar10", str(tmp_path / "tv"))
    assert [c[2] for c in fake_cifar.calls] == [False, False] and d.train_x.shape == (20, 3, 32, 32)
    fake_cifar.calls.clear()
    write_image_folder(tmp_path / "jpg")  # an ImageFolder copy: torchvision is not even asked
    assert load_dataset("cifar10", str(tmp_path / "jpg")).train_x.shape == (30, 3, 8, 8)
    assert fake_cifar.calls == []
    fake_cifar.corrupt = True  # a broken local copy is reported, not silently downloaded over
    ds.clear_memo()
    with pytest.raises(DataNotFoundError, match=r"has no readable CIFAR-10 \(Dataset not found or corrupted.*\): "
                                                r"delete .*tv/cifar-10-batches-py to download it again or extract"):
        load_dataset("cifar10", str(tmp_path / "tv"))
    assert [c[2] for c in fake_cifar.calls] == [False]


def test_download_by_default_into_root_or_the_cache(tmp_path: Path, isolated_cache: Path,
                                                    fake_cifar: type[FakeTorchvision]) -> None:
    root = tmp_path / "cifar"
    d = FederatedDataModule(name="cifar10", root=str(root), num_clients=2)  # data.download defaults to true
    assert d.download is True
    d.setup()
    assert fake_cifar.calls == [(str(root), True, True), (str(root), False, True)]
    assert d.base.train_x.shape == (20, 3, 32, 32) and int(d.base.test_x[0, 0, 0, 0]) == 9
    fake_cifar.calls.clear()
    ds.clear_memo()
    load_dataset("cifar10")  # no root: the documented download folder, $PL_FEDSPARSE_CACHE/cifar10
    assert ds.download_dir("cifar10") == isolated_cache / "cifar10"
    assert [c[:1] + c[2:] for c in fake_cifar.calls] == [(str(isolated_cache / "cifar10"), True)] * 2
    fake_cifar.calls.clear()
    ds.clear_memo()
    load_dataset("cifar10")  # downloaded once: the next run reads that copy
    assert [c[2] for c in fake_cifar.calls] == [False, False]


def test_failed_download_is_one_line(tmp_path: Path, fake_cifar: type[FakeTorchvision],
                                     capsys: pytest.CaptureFixture[str]) -> None:
    from conftest import TINY_CLI, one_line, run_main

    fake_cifar.offline = True
    root = tmp_path / "cifar"
    with pytest.raises(DataNotFoundError) as err:
        load_dataset("cifar10", str(root))
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"data.root={str(root)!r} has no CIFAR-10 (")
    assert f"the download into {root} failed (it needs network)" in msg and "tar -xzf cifar10-jpg.tar.gz" in msg
    assert [c[2] for c in fake_cifar.calls] == [True]
    # through pl-fed: the same single line, exit status 2
    code, _, err_text = run_main(["fit", *TINY_CLI, "--data.name", "cifar10", "--data.root", str(root),
                                  "--trainer.default_root_dir", str(tmp_path / "run")], capsys)
    line = one_line(err_text)
    assert code == 2 and "the download into" in line and "failed (it needs network)" in line
    # download: false never asks torchvision to download
    fake_cifar.calls.clear()
    with pytest.raises(DataNotFoundError, match=r"pass --data\.download true"):
        load_dataset("cifar10", str(tmp_path / "elsewhere"), download=False)
    assert fake_cifar.calls == []


def test_idx_download_goes_to_the_cache_and_is_found_there(isolated_cache: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import torchvision

    calls: list[tuple[str, bool]] = []

    class FakeMNIST:
        def __init__(self, root: str, train: bool = True, download: bool = False) -> None:
            calls.append((root, download))
            raise RuntimeError("the fake has no data")  # a failed download, as far as load_dataset can tell

    monkeypatch.setattr(torchvision.datasets, "MNIST", FakeMNIST)
    with pytest.raises(DataNotFoundError, match=r"^data\.root=None has no MNIST \(the fake has no data\): the "
                                                r"download into .*mnist failed"):
        load_dataset("mnist")
    assert calls == [(str(isolated_cache / "mnist"), True)]
    write_idx_set(isolated_cache / "mnist" / "MNIST" / "raw")  # where torchvision's MNIST download puts the files
    calls.clear()
    assert load_dataset("mnist").train_x.shape == (30, 1, 28, 28) and calls == []


# ------------------------------------------------------------------------------------------- loader


def tiny_tensors(n: int = 50) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=gen), torch.arange(n) % 10


def test_loader_batches_and_normalisation() -> None:
    x, y = tiny_tensors()
    loader = TensorBatchLoader(x, y, 16, shuffle=False, generator_seed=0, mean=(0.5, 0.4, 0.3), std=(0.2, 0.3, 0.4))
    batches = list(loader)
    assert len(loader) == len(batches) == 4 and [len(b[1]) for b in batches] == [16, 16, 16, 2]
    expected = (x[:16].float() / 255 - torch.tensor([0.5, 0.4, 0.3]).view(1, 3, 1, 1)) / torch.tensor(
        [0.2, 0.3, 0.4]).view(1, 3, 1, 1)
    assert torch.allclose(batches[0][0], expected, atol=1e-5)
    assert torch.equal(torch.cat([b[1] for b in batches]), y)
    assert len(TensorBatchLoader(x, y, 16, True, 0, (0.5,) * 3, (0.5,) * 3, drop_last=True)) == 3
    sub = TensorBatchLoader(x, y, 8, False, 0, (0.5,) * 3, (0.5,) * 3, indices=np.array([3, 7, 9]))
    assert len(sub) == 1 and next(iter(sub))[1].tolist() == [3, 7, 9]
    assert torch.allclose(normalize(x[:4], (0.5,) * 3, (0.5,) * 3), (x[:4].float() / 255 - 0.5) / 0.5, atol=1e-5)


@pytest.mark.parametrize("augment", [False, True])
def test_loader_reproducible_epochs_differ(augment: bool) -> None:
    x, y = tiny_tensors()

    def epochs(seed: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        loader = TensorBatchLoader(x, y, 16, True, seed, (0.5,) * 3, (0.25,) * 3, augment=augment)
        return [list(loader) for _ in range(2)]

    a, b, c = epochs(1), epochs(1), epochs(2)
    flat = [torch.cat([bx.flatten() for bx, _ in e]) for e in a]
    assert all(torch.equal(p, q) for p, q in zip(flat, [torch.cat([bx.flatten() for bx, _ in e]) for e in b]))
    assert not torch.equal(torch.cat([by for _, by in a[0]]), torch.cat([by for _, by in a[1]]))  # epochs differ
    assert not torch.equal(flat[0], torch.cat([bx.flatten() for bx, _ in c[0]]))
    assert all(bx.shape[1:] == (3, 32, 32) and bx.dtype == torch.float32 for bx, _ in a[0])
    assert sorted(torch.cat([by for _, by in a[0]]).tolist()) == sorted(y.tolist())


def test_augmentation_is_crop_and_flip() -> None:
    x = torch.full((64, 1, 32, 32), 255, dtype=torch.uint8)
    x[:, :, :, :16] = 0  # left half black, right half white
    loader = TensorBatchLoader(x, torch.zeros(64), 64, False, 0, (0.5,), (0.5,), augment=True)
    out = next(iter(loader))[0]
    assert out.shape == (64, 1, 32, 32)
    assert set(torch.unique(out).tolist()) <= {-1.0, 0.0, 1.0}  # zero padding = the mean after normalisation
    flipped = (out[:, 0, 16, 12] == 1.0) & (out[:, 0, 16, 20] == -1.0)
    assert 10 < int(flipped.sum()) < 54  # about half the images are flipped
    assert (out == 0).any()  # some crops show padding


def test_loader_works_with_lightning_fit(tmp_path: Path) -> None:
    import lightning

    class Tiny(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 10))

        def training_step(self, batch, batch_idx):
            x, yb = batch
            return torch.nn.functional.cross_entropy(self.net(x), yb)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    x, y = tiny_tensors()
    loader = TensorBatchLoader(x, y, 16, True, 0, (0.5,) * 3, (0.25,) * 3, augment=True)
    trainer = lightning.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(Tiny(), train_dataloaders=loader)
    assert trainer.global_step == 2 * len(loader)


# ------------------------------------------------------------------------------------------- datamodule


def test_datamodule_split_mode() -> None:
    dm = FederatedDataModule(num_clients=4, alpha=0.5, synthetic=TINY, batch_size=16, split_ratios=(0.6, 0.2, 0.2))
    dm.setup()
    dm.setup()  # idempotent
    assert dm.num_clients == 4 and dm.num_classes == 4 and dm.input_shape == (1, 8, 8)
    seen = []
    for k in range(4):
        parts = [dm.client_indices(k, s) for s in ("train", "val", "test")]
        assert all(len(p) > 0 for p in parts) and sum(map(len, parts)) == 100  # 400 // 4, DisPFL equal sizes
        assert len(np.unique(np.concatenate(parts))) == 100
        seen.append(np.concatenate(parts))
        assert dm.client_label_counts(k, "train").sum() == dm.num_samples(k, "train")
        assert len(dm.client_label_counts(k)) == 4
    assert len(np.unique(np.concatenate(seen))) == 400
    loader = dm.train_loader(0, seed=3)
    xb, yb = next(iter(loader))
    assert xb.shape == (16, 1, 8, 8) and xb.dtype == torch.float32 and len(loader) == -(-dm.num_samples(0) // 16)
    assert torch.equal(next(iter(dm.train_loader(0, seed=3)))[1], yb)
    test = dm.eval_loader(1, "test")
    assert sum(len(b[1]) for b in test) == dm.num_samples(1, "test")
    assert sum(len(b[1]) for b in dm.eval_loader(1, "val")) == dm.num_samples(1, "val")
    assert sorted(torch.cat([b[1] for b in test]).tolist()) == sorted(
        dm.base.train_y[dm.client_indices(1, "test")].tolist())
    shifted = dm.eval_loader(1, "test", shift=1.0, seed=0)
    assert sum(len(b[1]) for b in shifted) == dm.num_samples(1, "test")
    assert dm.example_input(3).shape == (3, 1, 8, 8) and dm.example_input().device.type == "cpu"


def test_datamodule_global_mode_and_subsample() -> None:
    dm = FederatedDataModule(num_clients=5, partition="pathological", classes_per_client=2, synthetic=TINY,
                             test_mode="global", test_per_client=30, max_train_samples=200)
    dm.setup()
    assert sum(dm.num_samples(k) for k in range(5)) == 200
    for k in range(5):
        held = np.flatnonzero(dm.client_label_counts(k, "train"))
        assert len(held) == 2
        test_counts = dm.client_label_counts(k, "test")
        assert set(np.flatnonzero(test_counts)) == set(held) and 30 <= test_counts.sum() <= 32
        assert dm.client_indices(k, "test").max() < 100  # indices into the base test split
        batches = list(dm.eval_loader(k, "test", shift=0.5, seed=1))
        assert sum(len(b[1]) for b in batches) == test_counts.sum()


@pytest.mark.parametrize("scheme", ["iid", "dirichlet", "shards", "noniid_ratio"])
def test_datamodule_schemes(scheme: str) -> None:
    dm = FederatedDataModule(num_clients=4, partition=scheme, synthetic=TINY, quantity_skew=True, min_samples=10)
    dm.setup()
    assert sum(dm.num_samples(k, s) for k in range(4) for s in ("train", "val", "test")) <= 400
    assert all(dm.num_samples(k, "test") >= 1 for k in range(4))


def test_fingerprint() -> None:
    a = FederatedDataModule(alpha=0.3, synthetic=TINY, batch_size=8, root="/x").fingerprint()
    b = FederatedDataModule(alpha=0.3, synthetic=TINY, batch_size=32, eval_batch_size=7).fingerprint()
    c = FederatedDataModule(alpha=0.5, synthetic=TINY).fingerprint()
    assert a == b and a != c
    assert json.loads(json.dumps(a)) == a
    assert "root" not in a and "device" not in a and "batch_size" not in a
    assert FederatedDataModule(partition="iid", alpha=0.3).fingerprint() == FederatedDataModule(
        partition="iid", alpha=0.9).fingerprint()


@pytest.mark.parametrize("kwargs,param", [
    ({"alpha": 0.0}, "data.alpha"), ({"alpha": -1}, "data.alpha"), ({"num_clients": 0}, "data.num_clients"),
    ({"batch_size": 0}, "data.batch_size"), ({"name": "foo"}, "data.name"), ({"partition": "x"}, "data.partition"),
    ({"split_ratios": (0.5, 0.2, 0.2)}, "data.split_ratios"), ({"split_ratios": (1.2, -0.2, 0.0)}, "data.split_ratios"),
    ({"split_ratios": (0.5, 0.5)}, "data.split_ratios"), ({"test_mode": "local"}, "data.test_mode"),
    ({"noniid_ratio": 2.0}, "data.noniid_ratio"), ({"min_samples": -1}, "data.min_samples"),
    ({"max_train_samples": 0}, "data.max_train_samples"), ({"synthetic": {"size": 2}}, "data.synthetic.size"),
    ({"seed": -1}, "data.seed"), ({"device": "nonsense"}, "data.device"), ({"emnist_split": "x"}, "data.emnist_split"),
])
def test_datamodule_validation(kwargs: dict, param: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{param.replace('.', r'.')}=.* is invalid: expected ") as err:
        FederatedDataModule(**kwargs)
    assert "\n" not in str(err.value)


def test_datamodule_setup_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^data\.num_clients=500 is invalid: expected at most the number"):
        FederatedDataModule(num_clients=500, synthetic=TINY).setup()
    with pytest.raises(ConfigError, match=r"^data\.split_ratios=.*too few"):
        FederatedDataModule(num_clients=400, partition="iid", synthetic=TINY).setup()
    with pytest.raises(DataNotFoundError, match=r"has no CIFAR-10"):
        FederatedDataModule(name="cifar10", root=str(tmp_path)).setup()
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"^data\.device='cuda' is invalid: expected .*CUDA is not available"):
            FederatedDataModule(device="cuda")


# ------------------------------------------------------------------------------------------- real data (skip if absent)


@pytest.mark.skipif(not (FASHION_DIR / "train-images-idx3-ubyte.gz").is_file(),
                    reason="apt-get install -y dataset-fashion-mnist")
def test_fashion_mnist_debian_package() -> None:
    d = load_dataset("fashion_mnist")  # root=None falls back to /usr/share/datasets/fashion-mnist
    assert d.train_x.shape == (60000, 1, 28, 28) and d.test_x.shape == (10000, 1, 28, 28)
    assert d.train_y.bincount().tolist() == [6000] * 10 and d.test_y.bincount().tolist() == [1000] * 10
    assert abs(d.train_x.float().mean().item() / 255 - d.mean[0]) < 1e-3


@pytest.fixture(scope="session")
def cifar_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An extracted CIFAR-10 JPEG copy: $PL_FEDSPARSE_CIFAR_ROOT, else the tarball extracted to a temp folder.

    Without ``PL_FEDSPARSE_REAL_DATA=1`` only a few images per class are streamed out of the tarball.
    """
    if os.environ.get("PL_FEDSPARSE_CIFAR_ROOT"):
        return Path(os.environ["PL_FEDSPARSE_CIFAR_ROOT"])
    if not CIFAR_TAR.is_file():
        pytest.skip(f"no CIFAR-10 copy ({CIFAR_TAR} missing)")
    dest = tmp_path_factory.mktemp("cifar10")
    full = os.environ.get("PL_FEDSPARSE_REAL_DATA") == "1"
    with tarfile.open(CIFAR_TAR, "r|gz") as tar:
        if full:
            tar.extractall(dest, filter="data")
            return dest
        want = {(s, c): 4 if s == "train" else 2 for s in ("train", "test") for c in CIFAR_CLASSES}
        for member in tar:
            parts = Path(member.name).parts
            key = parts[-3:-1] if len(parts) >= 3 else None
            if member.isfile() and key in want and want[key] > 0:
                want[key] -= 1
                out = dest.joinpath(*parts[-3:])
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(tar.extractfile(member).read())  # type: ignore[union-attr]
            if not any(want.values()):
                break
    return dest


@pytest.mark.slow
def test_cifar10_jpeg_copy(cifar_root: Path) -> None:
    t = time.perf_counter()
    d = load_dataset("cifar10", str(cifar_root))
    first = time.perf_counter() - t
    ds.clear_memo()
    t = time.perf_counter()
    again = load_dataset("cifar10", str(cifar_root))
    cached = time.perf_counter() - t
    print(f"CIFAR-10 {tuple(d.train_x.shape)}: decode {first:.2f}s, from cache {cached:.2f}s")
    assert torch.equal(again.train_x, d.train_x) and d.train_x.shape[1:] == (3, 32, 32) and d.num_classes == 10
    counts = d.train_y.bincount(minlength=10)
    assert (counts == counts[0]).all() and counts[0] in (4, 5000)
    if counts[0] == 5000:
        assert d.test_x.shape == (10000, 3, 32, 32)
        assert abs(d.train_x.float().mean().item() / 255 - 0.473) < 0.01


def test_partition_test_mode_builds_test_sets_like_the_training_sets() -> None:
    """FedPSE App. C.1: with lambda = 1 every client's test data has the labels of its training data, drawn from the
    base test split, which the clients' test sets cover exactly once."""
    dm = FederatedDataModule(name="synthetic", num_clients=4, partition="noniid_ratio", noniid_ratio=1.0,
                             test_mode="partition", batch_size=16,
                             synthetic={"num_train": 400, "num_test": 200, "size": 8, "channels": 1, "num_classes": 4})
    dm.setup()
    tests = [dm.client_indices(k, "test") for k in range(4)]
    assert sorted(np.concatenate(tests).tolist()) == list(range(200))
    for k in range(4):
        train_labels = set(np.nonzero(dm.client_label_counts(k, "train"))[0].tolist())
        test_labels = set(np.nonzero(dm.client_label_counts(k, "test"))[0].tolist())
        assert test_labels <= train_labels | {min(train_labels) - 1, max(train_labels) + 1}  # chunk borders
    assert dm.fingerprint()["test_mode"] == "partition"


def test_augmentation_drawn_up_front_gives_the_batches_drawn_one_by_one() -> None:
    """The epoch's crops and flips are drawn before its first batch (one copy to the device, none per step): the same
    generator numbers in the same order, so every batch equals the one-by-one draw's, last partial batch included."""
    from pl_fedsparse.data.loaders import TensorBatchLoader

    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (37, 3, 8, 8), dtype=torch.uint8, generator=g)
    labels = torch.arange(37) % 5
    loader = TensorBatchLoader(images, labels, 8, shuffle=True, generator_seed=3, mean=[0.5] * 3, std=[0.25] * 3,
                               augment=True)
    for epoch in range(2):
        loader.set_epoch(epoch)
        got = list(loader)
        loader.set_epoch(epoch)
        gen, batches = loader.epoch_batches()
        want = [(loader._augment(loader.inputs(rows), gen), labels.index_select(0, rows)) for rows in batches]
        assert len(got) == len(want) == 5
        for (x, y), (wx, wy) in zip(got, want):
            assert torch.equal(x, wx) and torch.equal(y, wy)


def test_a_dataset_cache_with_damaged_bytes_is_rebuilt_not_read(tmp_path: Path) -> None:
    """``torch.load`` does not check the archive's CRCs: a damaged byte in the cached pixels would be read as other
    pixels. The cache is checked member by member and rebuilt instead."""
    from pl_fedsparse.data.cache import _cache_load, _cache_save

    path = tmp_path / "c.pt"
    blob = {k: torch.arange(4096, dtype=torch.float32) for k in ("train_x", "train_y", "test_x", "test_y")}
    _cache_save(path, blob)
    assert _cache_load(path) is not None
    data = bytearray(path.read_bytes())
    at = len(data) // 2
    data[at:at + 4] = b"\x7f\x7f\x7f\x7f" if data[at:at + 4] != b"\x7f\x7f\x7f\x7f" else b"\x00" * 4
    path.write_bytes(bytes(data))
    assert _cache_load(path) is None
