"""``data.device: auto`` (the default): the in-memory dataset goes where the fits run when it fits there — asked by
the loop through the datamodule's optional ``place_data(device)``, only where the fits run in its process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tiny_datamodule, tiny_loop, tiny_module

from pl_fedsparse.data import FederatedDataModule
from pl_fedsparse.data import datamodule as dm_mod
from pl_fedsparse.errors import ConfigError


def _fake_accelerator(monkeypatch: pytest.MonkeyPatch, free: int) -> list[torch.device]:
    """A CUDA device with ``free`` bytes free, whose moves are recorded (the tensors stay on the CPU)."""
    moved: list[torch.device] = []
    real_to = torch.Tensor.to

    def to(t: torch.Tensor, *a: Any, **k: Any) -> torch.Tensor:
        dev = a[0] if a else k.get("device")
        if isinstance(dev, torch.device) and dev.type == "cuda":
            moved.append(dev)
            return t
        return real_to(t, *a, **k)

    monkeypatch.setattr(dm_mod, "_free_memory", lambda device: free)
    monkeypatch.setattr(torch.Tensor, "to", to)
    return moved


def _setup(**kw: Any) -> FederatedDataModule:
    dm = tiny_datamodule(**kw)
    dm.setup("fit")
    return dm


def test_auto_moves_the_dataset_to_an_accelerator_where_it_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    dm = _setup()
    need = sum(t.numel() * t.element_size() for t in (dm._train_x, dm._train_y, dm._test_x, dm._test_y))
    moved = _fake_accelerator(monkeypatch, free=int(need / dm_mod.AUTO_DATA_SHARE) + 1)
    assert dm.place_data("cuda") and len(moved) == 4  # images and labels, train and test
    moved.clear()
    small = _setup()
    monkeypatch.setattr(dm_mod, "_free_memory", lambda device: int(need / dm_mod.AUTO_DATA_SHARE) - 1)
    assert not small.place_data("cuda") and not moved  # more than its share of the free memory: stays
    for device in (None, "cpu"):  # data.device set: as asked, never moved by the loop
        assert not _setup(device=device).place_data("cuda")
    assert not moved
    assert not _setup().place_data("cpu")  # the CPU: nothing to do


def test_the_loop_places_the_data_where_its_fits_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop asks once, with its fits' device; not where the fits run in other processes (the executor has no
    device in this process: Ray); a datamodule without ``place_data`` runs as before."""
    calls: list[Any] = []
    monkeypatch.setattr(FederatedDataModule, "place_data", lambda self, device: calls.append(device) or False)
    loop = tiny_loop(tmp_path / "a", num_rounds=1)
    loop.fit(tiny_module(), tiny_datamodule())
    assert calls == [torch.device("cpu")]
    calls.clear()
    from pl_fedsparse.executors.in_process import InProcessExecutor

    monkeypatch.setattr(InProcessExecutor, "message_device", property(lambda self: None))
    loop = tiny_loop(tmp_path / "b", num_rounds=1)
    loop.fit(tiny_module(), tiny_datamodule())
    assert calls == []
    monkeypatch.delattr(FederatedDataModule, "place_data")
    loop = tiny_loop(tmp_path / "c", num_rounds=1)
    loop.fit(tiny_module(), tiny_datamodule())  # (optional: without it, nothing is asked)


def test_a_failing_place_data_is_one_line_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pl_fedsparse.errors import UserCodeError

    def boom(self: Any, device: Any) -> bool:
        raise RuntimeError("out of memory")

    monkeypatch.setattr(FederatedDataModule, "place_data", boom)
    with pytest.raises(UserCodeError, match="place_data.*out of memory"):
        tiny_loop(tmp_path, num_rounds=1).fit(tiny_module(), tiny_datamodule())


def test_data_device_values() -> None:
    assert FederatedDataModule().device == "auto"
    with pytest.raises(ConfigError, match=r"data.device='nonsense' is invalid: expected auto"):
        FederatedDataModule(device="nonsense")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("how", ["plain", "augment", "prepared", "features"])
def test_a_fits_loader_on_cuda_never_waits_for_the_device(how: str) -> None:
    """A loader made per fit over data on the GPU — its client's indices, each epoch's batch order and augmentation
    draws crossing from the host — makes no synchronising call (``torch.cuda.set_sync_debug_mode``: a copy from
    pageable memory would be one), and its batches are the CPU loader's (the labels bit for bit, the inputs to float
    rounding)."""
    from pl_fedsparse.data.loaders import AUGMENT_PAD, TensorBatchLoader, prepare_inputs

    g = torch.Generator().manual_seed(0)
    if how == "features":
        images, stats = torch.randn(300, 6, generator=g), ([0.1] * 6, [2.0] * 6)
    else:
        images, stats = torch.randint(0, 256, (300, 3, 8, 8), dtype=torch.uint8, generator=g), ([0.5] * 3, [0.25] * 3)
    labels, indices = torch.randint(0, 10, (300,), generator=g), torch.randperm(300, generator=g)[:100]

    def batches(device: str, strict: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
        x, y = images.to(device), labels.to(device)
        prepared = prepare_inputs(x, *stats, pad=AUGMENT_PAD) if how == "prepared" else None
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if strict and device == "cuda" else 0)
        try:
            loader = TensorBatchLoader(x, y, 16, shuffle=True, generator_seed=3, mean=stats[0], std=stats[1],
                                       augment=how in ("augment", "prepared"), indices=indices, prepared=prepared)
            out = [b for _ in range(2) for b in loader]
        finally:
            torch.cuda.set_sync_debug_mode(0)
        return [(a.cpu(), b.cpu()) for a, b in out]

    batches("cuda", strict=False)  # (the normalisation's constants made once and cached, as for every later fit)
    on_gpu, on_cpu = batches("cuda"), batches("cpu")
    assert len(on_gpu) == len(on_cpu) == 14
    for (a, b), (c, d) in zip(on_gpu, on_cpu):
        assert torch.equal(b, d) and torch.allclose(a, c, rtol=0, atol=1e-6)


def test_what_a_fits_loader_makes_on_the_host_crosses_through_the_pinned_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU too: the client's indices, each epoch's batch order and its augmentation draws go through
    ``transfer.send`` (on a GPU: pinned and without a wait; the test above checks that on CUDA), not ``Tensor.to``."""
    from pl_fedsparse.data import loaders
    from pl_fedsparse.functional import transfer

    sent: list[tuple[int, ...]] = []
    real = transfer.send

    def send(t: torch.Tensor, device: Any) -> torch.Tensor:
        sent.append(tuple(t.shape))
        return real(t, device)

    monkeypatch.setattr(transfer, "send", send)
    images = torch.randint(0, 256, (50, 3, 8, 8), dtype=torch.uint8)
    loader = loaders.TensorBatchLoader(images, torch.zeros(50, dtype=torch.long), 8, shuffle=True, generator_seed=0,
                                       mean=[0.5] * 3, std=[0.25] * 3, augment=True, indices=torch.arange(20))
    assert sent == [(20,)]
    for _ in range(2):
        list(loader)
    assert sent == [(20,)] + [(20,), (2, 20), (20,)] * 2  # (indices; per epoch: the order, the offsets, the flips)
