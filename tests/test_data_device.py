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
