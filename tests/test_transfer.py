"""State across the host link in few copies (:mod:`pl_fedsparse.functional.transfer`): packing keeps every bit, dtype
and shape; the store keeps what a fit sets on a device until the fit ends and brings it over in one copy; the fault
check waits once per fit; and a run that packs (as a device run does) gives the same numbers as one that does not."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from pl_fedsparse.client import ClientStateStore, ClientUpdate, Message
from pl_fedsparse.context import FitContext, fit_scope
from pl_fedsparse.executors.base import find_fault
from pl_fedsparse.functional import transfer

REPO = Path(__file__).resolve().parents[1]


def _ctx(k: int, r: int) -> FitContext:
    return FitContext(client_idx=k, round_idx=r, kind="train", stream="train", seed=0, lr_round=r)


def _mixed() -> list[torch.Tensor]:
    return [torch.randn(3, 5), torch.randn(4, 4).t(), torch.tensor(7), torch.tensor([True, False, True]),
            torch.randn(5).half(), torch.randn(6).bfloat16(), torch.arange(10, dtype=torch.uint8), torch.empty(0, 3),
            torch.tensor([-0.0, float("nan"), float("inf")]), torch.randint(0, 9, (2, 3), dtype=torch.int64)]


@pytest.mark.parametrize("share", [False, True])
def test_packing_keeps_every_bit_dtype_shape_and_stride_free_layout(share: bool) -> None:
    ts = _mixed()
    out = transfer.copy_tensors(ts, "cpu", share=share, force=True)
    for a, b in zip(ts, out):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.contiguous().view(-1).view(torch.uint8) if a.numel() else a.reshape(-1),
                           b.contiguous().view(-1).view(torch.uint8) if b.numel() else b.reshape(-1))  # bits (NaN, -0)
        assert b.data_ptr() != a.data_ptr() or a.numel() == 0
    storages = {t.untyped_storage().data_ptr() for t in out if t.numel()}
    assert (len(storages) == 1) if share else (len(storages) == sum(1 for t in out if t.numel()))


def test_packed_copies_are_aligned_and_independent_of_the_source() -> None:
    ts = [torch.ones(3), torch.zeros(5, dtype=torch.float64)]
    out = transfer.copy_tensors(ts, "cpu", share=True, force=True)
    base = out[0].untyped_storage().data_ptr()
    assert all((t.data_ptr() - base) % transfer.ALIGN == 0 for t in out)
    ts[0].add_(1)
    assert torch.equal(out[0], torch.ones(3))


def test_to_device_hands_back_what_is_there_and_packs_the_rest_once(monkeypatch: pytest.MonkeyPatch) -> None:
    m = {"a": torch.ones(2), "b": torch.zeros(3, dtype=torch.bool)}
    same = transfer.to_device(m, "cpu")
    assert same["a"] is m["a"] and same["b"] is m["b"]
    monkeypatch.setattr(transfer, "ALWAYS_PACK", True)
    calls = []
    real = transfer.copy_tensors
    monkeypatch.setattr(transfer, "copy_tensors", lambda ts, *a, **k: calls.append(len(ts)) or real(ts, *a, **k))
    moved = transfer.to_device(m, "cpu")
    again = transfer.to_device({**moved, "c": torch.ones(1)}, "cpu")  # only "c" has not crossed yet
    assert calls == [2, 1] and again["a"] is moved["a"]
    transfer._placed.clear()


def test_the_store_keeps_device_writes_of_a_fit_until_it_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfer, "ALWAYS_PACK", True)  # what a fit on a device does with its entries
    store = ClientStateStore()
    store.declare("opt", lambda k: {"m": torch.zeros(3)})
    store.declare("mask", lambda k: torch.ones(3, dtype=torch.bool))
    store.materialize([0, 1])
    before = store.export_client(0)
    calls = []
    real = transfer.copy_tensors
    monkeypatch.setattr(transfer, "copy_tensors", lambda ts, *a, **k: calls.append(len(ts)) or real(ts, *a, **k))
    with fit_scope(_ctx(0, 0)):
        store.set(0, "opt", {"m": torch.full((3,), 2.0)})
        store.set(0, "mask", torch.tensor([True, False, True]))
        assert calls == [] and store._pending == {0: ["opt", "mask"]}
    (up,) = store.flush_writes(0, extra=[torch.arange(4.0)])
    assert calls == [3]  # both entries and the upload: one copy
    assert torch.equal(up, torch.arange(4.0)) and not store._pending
    assert torch.equal(store.get(0, "opt")["m"], torch.full((3,), 2.0))
    assert store.get(0, "mask").tolist() == [True, False, True]
    ptrs = {store.get(0, "opt")["m"].untyped_storage().data_ptr(), store.get(0, "mask").untyped_storage().data_ptr()}
    assert len(ptrs) == 2  # kept entries do not share (nor keep alive) the copy's buffer
    with fit_scope(_ctx(0, 1)):  # a failed fit: its pending writes are dropped
        store.set(0, "mask", torch.zeros(3, dtype=torch.bool))
    store.restore_client(0, before)
    assert not store._pending and store.get(0, "mask").tolist() == [True, True, True]
    with fit_scope(_ctx(1, 0)):  # a checkpoint never sees a device tensor
        store.set(1, "mask", torch.zeros(3, dtype=torch.bool))
    assert store.state_dict()[1]["mask"].tolist() == [False] * 3 and not store._pending


def test_entries_moved_ahead_reach_the_device_without_another_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """``prefetch`` moves the client's entries with the start weights in one copy; the host copies ``get`` hands out
    in the fit then move to the device with no copy across the link, each move a copy of its own made there (so
    what one consumer does to it never reaches another), and a host copy changed in place crosses as usual."""
    monkeypatch.setattr(transfer, "ALWAYS_PACK", True)
    store = ClientStateStore()
    store.declare("gate", lambda k: {"w": torch.arange(3.0) + k, "b": torch.tensor([k])})
    store.declare("mask", lambda k: torch.tensor([True, False, bool(k)]))
    store.materialize([0, 1])
    calls = []
    real = transfer.copy_tensors
    monkeypatch.setattr(transfer, "copy_tensors", lambda ts, *a, **k: calls.append(len(ts)) or real(ts, *a, **k))
    try:
        with fit_scope(_ctx(1, 0)):
            (start,) = store.prefetch(1, "cpu", extra=[torch.ones(2)])
            assert calls == [4] and torch.equal(start, torch.ones(2))  # 3 entry tensors + the start weights: 1 copy
            gate, mask = store.get(1, "gate"), store.get(1, "mask")
            first = transfer.to_device({**gate, "mask": mask}, "cpu")
            assert calls == [4]  # no copy across the link
            assert torch.equal(first["w"], torch.arange(3.0) + 1) and first["mask"].tolist() == [True, False, True]
            first["w"].add_(100)  # a consumer's in-place step on its device copy
            again = transfer.to_device(gate, "cpu")
            assert calls == [4] and torch.equal(again["w"], torch.arange(3.0) + 1)
            mask[1] = True  # the host copy changed: it crosses as it is
            assert transfer.to_device({"mask": mask}, "cpu")["mask"].tolist() == [True, True, True]
            assert calls == [4, 1]
        store.end_prefetch(1)
        assert not transfer._twins and not store._prefetched
        assert store.get(1, "gate")["w"].tolist() == [1.0, 2.0, 3.0]  # the stored entries untouched
    finally:
        transfer.clear_twins()
        transfer._placed.clear()


def test_the_fault_check_names_the_first_bad_tensor_with_one_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    good, nan = torch.ones(2), torch.tensor([1.0, float("nan")])
    u = ClientUpdate(0, 0, 1, {"a": good, "b": nan, "c": nan.clone()}, metrics={"train_loss": 0.5})
    assert find_fault(u) == ("nonfinite_weights", "b")
    u = ClientUpdate(0, 0, 1, {"a": good}, message=Message({"a": good, "up": nan}), metrics={"train_loss": 0.5})
    assert find_fault(u) == ("nonfinite_upload", "up")
    assert find_fault(ClientUpdate(0, 0, 1, {"a": good}, message=Message({"a": good}), metrics={})) == (None, None)
    waits = []
    real_bool = torch.Tensor.__bool__
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda t: waits.append(1) or real_bool(t))
    find_fault(ClientUpdate(0, 0, 1, {f"w{i}": torch.ones(3) for i in range(20)}, metrics={}))
    assert len(waits) == 1


def _metrics(run: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(x).items() if not k.startswith("time")}
            for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fedspa", "dmpfl", "pfedgate", "fedpse"])
def test_a_run_that_packs_as_a_device_run_gives_the_same_numbers(name: str, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    import device_traffic
    from conftest import run_main

    monkeypatch.chdir(REPO)
    cfg, extra = device_traffic.CONFIGS[name]
    rows = []
    for pack in (False, True):
        monkeypatch.setattr(transfer, "ALWAYS_PACK", pack)
        run = tmp_path / str(pack)
        args = ["fit", "--config", cfg, *extra, "--trainer.eval_every", "1", "--trainer.enable_progress_bar", "false",
                "--trainer.default_root_dir", str(run)]
        if "--trainer.num_rounds" not in extra:
            args += ["--trainer.num_rounds", "2"]
        code, _, err = run_main(args, capsys)
        assert code == 0, err
        rows.append(_metrics(run))
    transfer._placed.clear()
    assert rows[0] == rows[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_packing_across_the_link_keeps_every_bit_and_is_one_copy_each_way() -> None:
    from torch.profiler import ProfilerActivity, profile

    ts = _mixed()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        on = transfer.copy_tensors(ts, "cuda")
        back = transfer.copy_tensors(on, "cpu")
        torch.cuda.synchronize()
    assert all(t.is_cuda for t in on) and all(t.device.type == "cpu" for t in back)
    for a, b in zip(ts, back):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.reshape(-1).view(torch.uint8) if a.numel() else a.reshape(-1),
                           b.reshape(-1).view(torch.uint8) if b.numel() else b.reshape(-1))
    copies = [e for e in prof.events() if "Memcpy HtoD" in e.name or "Memcpy DtoH" in e.name]
    assert sum("HtoD" in e.name for e in copies) == 1 and sum("DtoH" in e.name for e in copies) == 1, \
        [e.name for e in copies]
