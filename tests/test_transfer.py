"""State across the host link in few copies (:mod:`pl_fedsparse.functional.transfer`): packing keeps every bit, dtype
and shape; the store keeps what a fit sets on a device until the fit ends and brings it over in one copy; the fault
check waits once per fit; and a run that packs (as a device run does) gives the same numbers as one that does not."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from pl_fedsparse.callbacks import FederatedCallback
from pl_fedsparse.client import ClientStateStore, ClientUpdate, Message
from pl_fedsparse.context import FitContext, fit_scope
from pl_fedsparse.errors import ConfigError
from pl_fedsparse.executors.base import find_fault
from pl_fedsparse.functional import transfer
from pl_fedsparse.testing import simulated_device

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


@pytest.mark.parametrize("path", ["host", "device"])
def test_the_fault_check_names_the_first_bad_tensor_with_one_wait(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    from pl_fedsparse.executors import base

    if path == "device":  # (the device path's operations, run on the CPU)
        monkeypatch.setattr(base.transfer, "on_a_device", lambda tensors: True)
    good, nan = torch.ones(2), torch.tensor([1.0, float("nan")])
    u = ClientUpdate(0, 0, 1, {"a": good, "b": nan, "c": nan.clone()}, metrics={"train_loss": 0.5})
    assert find_fault(u) == ("nonfinite_weights", "b")
    u = ClientUpdate(0, 0, 1, {"a": good}, message=Message({"a": good, "up": nan}), metrics={"train_loss": 0.5})
    assert find_fault(u) == ("nonfinite_upload", "up")
    assert find_fault(ClientUpdate(0, 0, 1, {"a": good}, message=Message({"a": good}), metrics={})) == (None, None)
    _every_nonfinite_kind(torch.device("cpu"))
    waits = []
    real_bool = torch.Tensor.__bool__
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda t: waits.append(1) or real_bool(t))
    find_fault(ClientUpdate(0, 0, 1, {f"w{i}": torch.ones(3) for i in range(20)}, metrics={}))
    assert len(waits) == 1
    monkeypatch.setattr(torch.Tensor, "__bool__", real_bool)
    from conftest import count_operators

    def ops(n: int) -> int:  # (the same operators for 3 tensors or 30)
        update = ClientUpdate(0, 0, 1, {f"w{i}": torch.ones(3) for i in range(n)}, metrics={})
        return count_operators(lambda: find_fault(update))

    assert ops(3) == ops(30)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
def test_the_fault_check_on_cuda_names_the_first_bad_tensor() -> None:
    _every_nonfinite_kind(torch.device("cuda"))


def _every_nonfinite_kind(device: torch.device) -> None:
    """Every kind of non-finite value, in every float dtype, is found; empty tensors and the largest finite halves
    pass."""
    big = torch.tensor([65504.0, -65504.0], dtype=torch.float16, device=device)
    for bad in (float("nan"), float("inf"), float("-inf")):
        for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            t = torch.zeros(5, dtype=dtype, device=device)
            t[3] = bad
            state = {"empty": torch.empty(0, device=device), "big": big, "ok": torch.ones(2, device=device), "bad": t,
                     "later": t.clone()}
            assert find_fault(ClientUpdate(0, 0, 1, state, metrics={})) == ("nonfinite_weights", "bad"), (bad, dtype)
    assert find_fault(ClientUpdate(0, 0, 1, {"e": torch.empty(0, device=device), "big": big}, metrics={})) == \
        (None, None)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fedspa", "dispfl", "dmpfl", "pfedgate", "fedpse"])
def test_a_simulated_device_run_gives_the_same_numbers_and_mixes_no_sides(name: str, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    import device_traffic
    from conftest import metric_rows, run_main

    monkeypatch.chdir(REPO)
    cfg, extra = device_traffic.CONFIGS[name]
    rows = []
    for pack in (False, True):
        run = tmp_path / str(pack)
        args = ["fit", "--config", cfg, *extra, "--trainer.eval_every", "1", "--trainer.enable_progress_bar", "false",
                "--trainer.on_client_fault", "raise", "--trainer.default_root_dir", str(run)]
        if "--trainer.num_rounds" not in extra:
            args += ["--trainer.num_rounds", "2"]
        # as a device run: packed copies, the kernels' device paths, what is computed on "the device" known to be
        # there (the update stays there through the callbacks and crosses at the fit's end), and a tensor meeting
        # the device from the host fails as on a GPU (strict)
        with simulated_device() if pack else contextlib.nullcontext():
            code, _, err = run_main(args, capsys)
        assert code == 0, err
        rows.append(metric_rows(run))
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


def test_a_simulated_device_places_what_is_computed_from_placed_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``ALWAYS_PACK`` and :class:`~pl_fedsparse.functional.transfer.PlacementTracker` (the device-traffic
    counter's view of a device run on the CPU), what an operator computes from a tensor "on the device" is there too
    (moving it there again costs no copy), host copies are on the host, and a record dies with its tensor."""
    monkeypatch.setattr(transfer, "ALWAYS_PACK", True)
    host = torch.arange(4.0)
    try:
        with transfer.PlacementTracker():
            on = transfer.to_device({"w": host}, "cpu")["w"]
            derived = (on.abs() > 1, on.clone(), on[1:])
            assert transfer.placed_on(host) is None and transfer.placed_on(on) == "cpu"
            assert all(transfer.placed_on(t) == "cpu" for t in derived)
            assert transfer.on_a_device(derived) and not transfer.on_a_device([host, host * 2])
            (back,) = transfer.copy_tensors([on], "cpu")  # a host copy
            assert transfer.placed_on(back) is None and torch.equal(back, host)
            calls = []
            real = transfer.copy_tensors
            monkeypatch.setattr(transfer, "copy_tensors", lambda ts, *a, **k: calls.append(len(ts)) or real(ts, *a,
                                                                                                            **k))
            transfer.to_device({"m": derived[0], "c": derived[1]}, "cpu")
            assert not any(calls)  # computed there: nothing crosses
            assert transfer.to_where({"h": host, "d": derived[1]}, host)["d"] is not derived[1]
            assert [c for c in calls if c] == [1]  # to the host: the one "on the device"
            n = len(transfer._placed)
            del derived, on
            assert len(transfer._placed) < n  # (weak records: a dead tensor's is dropped)
    finally:
        transfer._placed.clear()


def test_an_update_reaches_the_host_in_one_copy_and_stays_one_update(monkeypatch: pytest.MonkeyPatch) -> None:
    """``update_to_host``: every tensor of an update left on the device (state, message, masks, extras, 0-dim
    metrics) crosses in one copy; a tensor held in two places is still one tensor after it; host tensors stay."""
    from pl_fedsparse.executors.base import update_to_host

    monkeypatch.setattr(transfer, "ALWAYS_PACK", True)
    try:
        with transfer.PlacementTracker():
            w = transfer.to_device({"w": torch.arange(3.0)}, "cpu")["w"]
            mask, host = w > 0, torch.ones(2)
            u = ClientUpdate(0, 0, 3, {"w": w, "h": host}, message=Message({"w": w}, {"w": mask}), masks={"w": mask},
                             extras={"next": {"w": mask}, "n": 3}, metrics={"loss": w.sum() / 3, "n": 3.0})
            calls = []
            update_to_host(u, lambda ts: calls.append(list(ts)) or transfer.copy_tensors(ts, "cpu"))
            assert len(calls) == 1 and len(calls[0]) == 3  # w, its mask, the loss: once each
            assert not transfer.on_a_device([u.state["w"], u.masks["w"], u.extras["next"]["w"]])
            assert u.state["h"] is host and u.message.tensors["w"] is u.state["w"]
            assert u.message.masks["w"] is u.masks["w"] is u.extras["next"]["w"]
            assert u.metrics == {"loss": 1.0, "n": 3.0} and isinstance(u.metrics["loss"], float)
            assert u.extras["n"] == 3 and u.state["w"].tolist() == [0.0, 1.0, 2.0]
    finally:
        transfer._placed.clear()


@pytest.mark.slow
def test_a_callback_that_does_not_say_so_gets_the_update_on_the_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """The contract of ``on_client_fit_end``: ``update.state`` holds host copies unless the hook's class sets
    ``device_update`` — checked on a simulated device run, where the library's callbacks take it on the device."""
    from conftest import run_main

    from pl_fedsparse.callbacks import FederatedCallback
    from pl_fedsparse.callbacks.base import takes_device_update
    from pl_fedsparse.callbacks.masking import SparseMask

    seen: list[bool] = []

    class Mine(SparseMask):  # a user's override of a library hook: host copies, whatever its parent says
        def on_client_fit_end(self, loop, module, update):  # type: ignore[no-untyped-def]
            seen.append(transfer.on_a_device(update.state.values()))
            super().on_client_fit_end(loop, module, update)

    assert takes_device_update([SparseMask()]) and not takes_device_update([SparseMask(), Mine()])
    assert takes_device_update([FederatedCallback()])
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(transfer, "ALWAYS_PACK", True)
    monkeypatch.setattr(sys.modules[__name__], "Mine", Mine, raising=False)
    try:
        with transfer.PlacementTracker():
            code, _, err = run_main(["fit", "--config", "configs/synthetic_fedavg.yaml", "--trainer.num_rounds", "1",
                                     "--trainer.callbacks+", f"{__name__}.Mine", "--trainer.enable_progress_bar",
                                     "false", "--trainer.default_root_dir", str(tmp_path / "mine")], capsys)
            assert code == 0, err
            assert seen and not any(seen)
            seen.clear()
            monkeypatch.setattr(Mine, "device_update", True, raising=False)
            code, _, err = run_main(["fit", "--config", "configs/synthetic_fedavg.yaml", "--trainer.num_rounds", "1",
                                     "--trainer.callbacks+", f"{__name__}.Mine", "--trainer.enable_progress_bar",
                                     "false", "--trainer.default_root_dir", str(tmp_path / "says")], capsys)
            assert code == 0, err
            assert seen and all(seen)
    finally:
        transfer._placed.clear()


def test_packing_many_tensors_is_one_concatenation() -> None:
    """The tensors' bytes reach the buffer by one concatenation on their device — on a GPU a launch or two, not one
    per tensor: packing 40 tensors costs the operators of packing 4 (and the copies are their values, bit for bit,
    every dtype, 0-dim and empty ones, a non-contiguous one). Fails when a copy per tensor comes back."""
    from conftest import count_operators

    from pl_fedsparse.functional.transfer import copy_tensors

    g = torch.Generator().manual_seed(0)
    kinds = [lambda: torch.randn(3, 5, generator=g), lambda: torch.randint(0, 9, (7,), generator=g),
             lambda: torch.rand(4, generator=g) < 0.5, lambda: torch.tensor(2.5, dtype=torch.float64),
             lambda: torch.randn(6, generator=g).to(torch.bfloat16), lambda: torch.empty(0)]

    def packed_ops(n: int) -> tuple[int, list[Any], list[Any]]:
        tensors = [kinds[i % len(kinds)]() for i in range(n)]
        out: list[Any] = []
        return count_operators(lambda: out.extend(copy_tensors(tensors, "cpu", force=True, share=True))), tensors, out

    packed_ops(1)  # (the gap filler is made once per device)
    few, _, _ = packed_ops(4)
    many, tensors, out = packed_ops(40)
    assert many == few, (few, many)
    assert all(torch.equal(a, b) and a.dtype == b.dtype and a.shape == b.shape for a, b in zip(tensors, out))
    strided = torch.arange(12.0).view(3, 4).t()
    assert torch.equal(copy_tensors([strided, torch.ones(2)], "cpu", force=True)[0], strided)


def test_clones_and_copies_of_many_tensors_are_one_operator() -> None:
    """``clone_tensors`` and ``copy_into`` (a fit's update copied where it trained, a state loaded into a module, a
    client's entries read privately): one multi-tensor copy for any number of tensors — with each tensor's values,
    dtype and strides, a conversion where the target's dtype differs, and no autograd. Fails when a copy per tensor
    comes back."""
    from conftest import count_operators as ops

    from pl_fedsparse.executors.base import _load_into
    from pl_fedsparse.functional.transfer import clone_tensors, copy_into

    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(3, 4, generator=g).t(), torch.tensor(True), torch.randint(0, 5, (6,), generator=g),
               torch.randn(5, generator=g).to(torch.bfloat16)] * 10
    out: list[Any] = []
    assert ops(lambda: out.extend(clone_tensors(tensors))) == ops(lambda: clone_tensors(tensors[:4])) == 1
    assert all(torch.equal(a, b) and a.dtype == b.dtype and a.stride() == b.stride() and a.data_ptr() != b.data_ptr()
               for a, b in zip(tensors, out))
    targets = [torch.zeros(4, 3, dtype=torch.float64), torch.zeros((), dtype=torch.bool)]
    assert ops(lambda: copy_into(targets, tensors[:2])) == 1
    assert targets[0].dtype == torch.float64 and torch.equal(targets[0], tensors[0].double())
    module = torch.nn.Sequential(*[torch.nn.Linear(3, 3) for _ in range(10)])
    state = {k: torch.randn(v.shape, generator=g) for k, v in module.state_dict().items()}
    assert ops(lambda: _load_into(module.state_dict(keep_vars=True), state)) == 1
    assert all(torch.equal(module.state_dict()[k], v) for k, v in state.items())
    assert all(p.requires_grad and p.grad_fn is None for p in module.parameters())


def test_abs_tensors_is_one_multi_tensor_abs_with_the_values_of_each() -> None:
    """Dense tensors on one device: one ``_foreach_abs`` (any number of tensors), the values of ``t.abs()`` — signed
    zeros, infinities and NaN included; sparse tensors one by one."""
    from conftest import count_operators

    from pl_fedsparse.functional.transfer import abs_tensors

    ts = [torch.tensor([-0.0, 0.0, -float("inf"), float("nan"), -2.5]), torch.tensor(-3, dtype=torch.int64),
          torch.tensor([[-1.0, 2.0]], dtype=torch.float16)]
    got = abs_tensors(ts)
    assert all(torch.equal(a, t.abs()) or (a.isnan() == t.abs().isnan()).all() for a, t in zip(got, ts))
    assert torch.equal(got[0].signbit(), torch.zeros(5, dtype=torch.bool))
    many = [torch.randn(3) for _ in range(20)]
    assert count_operators(lambda: abs_tensors(many[:2])) == count_operators(lambda: abs_tensors(many)) == 1
    sparse = torch.tensor([[0.0, -1.0]]).to_sparse()
    out = abs_tensors([torch.tensor([-1.0]), sparse])
    assert out[1].is_sparse and torch.equal(out[1].to_dense(), torch.tensor([[0.0, 1.0]]))
    assert abs_tensors([]) == []


# ---- pinned staging (trainer.pin_memory) --------------------------------------------------------------------------
class _StagingProbe(FederatedCallback):
    """Records whether the copies across the host link are staged in pinned memory inside the fit."""

    scratch_attributes = ("seen",)  # a probe for the test, not state a resume needs

    def __init__(self) -> None:
        self.seen: bool | None = None

    def on_federation_start(self, loop: Any) -> None:
        self.seen = transfer.PIN_MEMORY


@pytest.mark.parametrize("pinned", [False, True])
def test_pin_memory_holds_during_the_fit_only(tmp_path: Path, pinned: bool) -> None:
    """``trainer.pin_memory`` is what the fit's copies see, and the process default is back after the fit — also
    after a fit that fails."""
    from conftest import tiny_datamodule, tiny_loop, tiny_module

    assert transfer.PIN_MEMORY
    probe = _StagingProbe()
    tiny_loop(tmp_path / "a", num_rounds=1, pin_memory=pinned, callbacks=[probe]).fit(tiny_module(), tiny_datamodule())
    assert probe.seen is pinned and transfer.PIN_MEMORY
    broken = tiny_loop(tmp_path / "b", num_rounds=1, pin_memory=pinned)
    broken.run_round = lambda r: 1 / 0  # type: ignore[method-assign,assignment,return-value]
    with pytest.raises(ZeroDivisionError):
        broken.fit(tiny_module(), tiny_datamodule())
    assert transfer.PIN_MEMORY


def test_pin_memory_must_be_a_bool(tmp_path: Path) -> None:
    from conftest import tiny_loop

    with pytest.raises(ConfigError, match=r"trainer.pin_memory.*'yes'.*true or false"):
        tiny_loop(tmp_path, pin_memory="yes")


def test_pinned_staging_only_between_the_host_and_a_cuda_device(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda, mps = torch.device("cpu"), torch.device("cuda", 0), torch.device("mps")
    monkeypatch.setattr(transfer, "_PINNING_FAILED", False)
    assert transfer._stages_pinned(cpu, cuda) and transfer._stages_pinned(cuda, cpu)
    assert not any(transfer._stages_pinned(a, b) for a, b in ((cpu, cpu), (cuda, cuda), (cpu, mps), (mps, cpu)))
    with transfer.host_staging(False):
        assert not transfer._stages_pinned(cpu, cuda)
    assert transfer._stages_pinned(cpu, cuda)
    monkeypatch.setattr(transfer, "_PINNING_FAILED", True)
    assert not transfer._stages_pinned(cpu, cuda)


def test_without_pinned_memory_the_copies_go_pageable_after_one_warning(monkeypatch: pytest.MonkeyPatch,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """Where page-locked memory cannot be had (a locked-memory limit; no driver), the first attempt warns in one line
    and the process stages in pageable memory from then on — nothing fails, and no attempt is made again."""
    real_empty, attempts = torch.empty, []

    def empty(*args: Any, **kw: Any) -> torch.Tensor:
        if kw.get("pin_memory"):
            attempts.append(args)
            raise RuntimeError("cudaHostAlloc failed: out of memory\n(a second line)")
        return real_empty(*args, **kw)

    monkeypatch.setattr(transfer, "_PINNING_FAILED", False)
    monkeypatch.setattr(transfer.torch, "empty", empty)
    with caplog.at_level("WARNING", logger=transfer.__name__):
        assert transfer._pinned_bytes(64) is None and transfer._pinned_bytes(64) is None
    assert len(attempts) == 1
    warned = [r.getMessage() for r in caplog.records if "pin_memory" in r.getMessage()]
    assert len(warned) == 1 and "cudaHostAlloc failed: out of memory" in warned[0] and "second line" not in warned[0]
    assert not transfer._stages_pinned(torch.device("cpu"), torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("pinned", [True, False])
def test_pinned_or_pageable_staging_keeps_every_bit_on_cuda(pinned: bool) -> None:
    """The same bytes either way; staged in pinned memory, what comes back to the host (as views of the buffer, the
    update the server aggregates) is page-locked, and pageable otherwise."""
    ts = _mixed()
    with transfer.host_staging(pinned):
        on = transfer.copy_tensors(ts, "cuda", share=True)
        back = transfer.copy_tensors(on, "cpu", share=True)
        kept = transfer.copy_tensors(on, "cpu")  # (tensors of their own: a client's stored state, pageable)
    for a, b, c in zip(ts, back, kept):
        assert a.dtype == b.dtype == c.dtype and a.shape == b.shape == c.shape
        bits = [t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1) for t in (a, b, c)]
        assert torch.equal(bits[0], bits[1]) and torch.equal(bits[0], bits[2])
    assert all(b.is_pinned() is pinned for b in back)
    assert not any(c.is_pinned() for c in kept)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_pinned_copy_to_cuda_does_not_wait_for_the_device_and_keeps_its_bytes() -> None:
    """Staged in pinned memory, a copy to the GPU is queued behind the work already there instead of waiting for it
    (a pageable copy waits for the stream: the host stalls at every fit's start); and a staging buffer freed at once
    is not handed out again before its copy ran (twenty copies queued behind a busy stream keep their values); nor do
    the small values a fit makes on the host (``transfer.host_tensor``, ``transfer.send``)."""
    stream = torch.cuda.current_stream()

    def copies() -> list[torch.Tensor]:
        return [transfer.copy_tensors([torch.full((1000,), float(i))], "cuda")[0] for i in range(20)]

    with transfer.host_staging(True):  # (torch's pinned blocks made once, as in a run's first fits: making one may
        copies()                       # wait for the device; later fits reuse them)
        transfer.host_tensor([3, 4], "cuda"), transfer.send(torch.arange(5) * 2, "cuda")
    for pinned in (False, True):
        torch.cuda.synchronize()
        with transfer.host_staging(pinned):
            torch.cuda._sleep(200_000_000)  # (about 0.1 s of a busy device)
            outs = copies()
            waited = stream.query()
        torch.cuda.synchronize()
        assert waited is not pinned, "a pinned copy waited for the device" if pinned else "the stream was idle"
        assert all(torch.equal(o.cpu(), torch.full((1000,), float(i))) for i, o in enumerate(outs))
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    small = [transfer.host_tensor([3, 4], "cuda"), transfer.send(torch.arange(5) * 2, "cuda")]
    assert not stream.query(), "a small host-made value waited for the device"
    assert small[0].tolist() == [3, 4] and small[1].tolist() == [0, 2, 4, 6, 8]
