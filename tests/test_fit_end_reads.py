"""Reads of device values put off until a fit's update crosses to the host (``ClientUpdate.on_host``): the training
loss, which readjusted masks changed, and DM-PFL's stored weights gathered at host-known sizes
(``functional.sparse.masked_values``) — the same numbers as reading them at once, with no wait of their own on a
GPU. The counts per fit are held in ``tests/test_device_traffic.py``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pl_fedsparse.client import ClientUpdate, Message
from pl_fedsparse.errors import ConfigError
from pl_fedsparse.metrics import PendingMetric, StepLosses


def _on_device(monkeypatch: pytest.MonkeyPatch, module: Any, tensors: list[torch.Tensor]) -> None:
    """``tensors`` are "on a device" for ``module``'s ``transfer.on_a_device``."""
    ids = {id(t) for t in tensors}
    monkeypatch.setattr(module.transfer, "on_a_device", lambda ts: any(id(t) in ids for t in ts))


def test_a_put_off_read_crosses_with_the_update_in_its_one_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    from pl_fedsparse.executors import base

    w, flags, mask = torch.ones(3), torch.tensor([2, 0]), torch.tensor([True, False, True])
    _on_device(monkeypatch, base, [w, flags, mask])
    u = ClientUpdate(0, 0, 1, {"w": w}, message=Message({"w": w}, {}), metrics={})
    seen: list[Any] = []
    u.on_host([flags], lambda host: seen.append(host[0]))
    # (a second read, run after the first: it sees what the first did, and edits the message before its copy)
    u.on_host([flags], lambda host: u.message.masks.update(m=mask) if seen else None)  # type: ignore[union-attr]
    copies: list[list[torch.Tensor]] = []

    def copy(ts: list[torch.Tensor]) -> list[torch.Tensor]:
        copies.append(list(ts))
        return [t.clone() for t in ts]

    base.update_to_host(u, copy)
    assert len(copies) == 1 and {id(t) for t in copies[0]} == {id(w), id(flags)}, "one copy, the read with the weights"
    assert seen[0] is not flags and torch.equal(seen[0], flags), "the read gets the host copy"
    assert u.pending == [] and u.message is not None and u.message.masks["m"] is mask  # (read after the scan)
    assert u.state["w"] is not w and torch.equal(u.state["w"], w)


def test_on_the_host_a_put_off_read_gets_the_tensors_as_they_are() -> None:
    from pl_fedsparse.executors import base

    flags = torch.tensor([1, 0])
    u = ClientUpdate(0, 0, 1, {"w": torch.ones(2)}, metrics={})
    seen: list[Any] = []
    u.on_host([flags], lambda host: seen.append(host[0]))
    base.update_to_host(u, lambda ts: [t.clone() for t in ts])
    assert seen == [flags] and seen[0] is flags and u.pending == []


@pytest.mark.parametrize("dtype, cast_float, start_at_zero", [(torch.float32, False, True),
                                                               (torch.bfloat16, True, False),
                                                               (torch.float16, True, True)])
def test_the_loss_read_with_the_update_is_the_same_number(dtype: torch.dtype, cast_float: bool,
                                                          start_at_zero: bool) -> None:
    g = torch.Generator().manual_seed(3)
    now, later = StepLosses(cast_float=cast_float, start_at_zero=start_at_zero), \
        StepLosses(cast_float=cast_float, start_at_zero=start_at_zero)
    for _ in range(37):
        loss = (torch.rand((), generator=g) * 5).to(dtype)
        n = int(torch.randint(1, 65, (), generator=g))
        now.add(loss, n)
        later.add(loss, n)
    u = ClientUpdate(0, 0, 1, {})
    u.metrics = later.metrics_on_host(u)  # type: ignore[assignment]
    assert isinstance(u.metrics["train_loss"], PendingMetric) and len(u.pending) == 1
    u.resolve_pending()
    assert u.metrics == now.metrics() and list(u.metrics) == ["train_loss", "samples_seen"]


def test_a_loss_not_read_yet_says_when_it_is() -> None:
    s = StepLosses()
    s.add(torch.tensor(0.5), 4)
    u = ClientUpdate(0, 0, 1, {})
    u.metrics = s.metrics_on_host(u)  # type: ignore[assignment]
    with pytest.raises(TypeError, match=r"update.metrics\['train_loss'\] is read when the fit ends"):
        float(u.metrics["train_loss"])
    with pytest.raises(TypeError, match="device_update"):
        u.metrics["train_loss"] * 2  # type: ignore[operator]
    u.resolve_pending()
    assert u.metrics["train_loss"] == 0.5
    empty = StepLosses()  # (no step: nothing to read, the numbers now)
    assert empty.metrics_on_host(u) == {"train_loss": pytest.approx(float("nan"), nan_ok=True), "samples_seen": 0.0}


@pytest.mark.parametrize("shape", [(7,), (4, 5), (3, 2, 3, 3)])
def test_masked_values_at_host_known_counts_are_the_bool_index(shape: tuple[int, ...],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from pl_fedsparse.functional import sparse

    g = torch.Generator().manual_seed(len(shape))
    ts = [torch.randn(shape, generator=g) for _ in range(3)]
    ms = [torch.rand(shape, generator=g) < 0.4, torch.zeros(shape, dtype=torch.bool),
          torch.ones(shape, dtype=torch.bool)]
    want = [t[m] for t, m in zip(ts, ms)]
    counts = [int(m.sum()) for m in ms]
    host = sparse.masked_values(ts, ms, counts)
    _on_device(monkeypatch, sparse, ts + ms)  # the device's path: positions by nonzero_static at the counts
    gathered: list[int] = []
    nonzero_static = torch.nonzero_static
    monkeypatch.setattr(torch, "nonzero_static", lambda m, size: gathered.append(size) or nonzero_static(m, size=size))
    dev = sparse.masked_values(ts, ms, counts)
    assert gathered == counts, "the device path sizes each gather from the host's count"
    for a, b, c in zip(want, host, dev):
        assert torch.equal(a, b) and torch.equal(a, c) and c.dim() == 1
    # a wrong count: found where the masks are on the host
    monkeypatch.undo()
    with pytest.raises(ConfigError, match=r"counts\[0\]"):
        sparse.masked_values(ts, ms, [counts[0] + 1, *counts[1:]])


def test_masked_values_refuses_mismatched_inputs() -> None:
    from pl_fedsparse.functional.sparse import masked_values

    with pytest.raises(ConfigError, match="masks"):
        masked_values([torch.ones(2)], [])
    with pytest.raises(ConfigError, match=r"masks\[0\]"):
        masked_values([torch.ones(2)], [torch.ones(3, dtype=torch.bool)])
    with pytest.raises(ConfigError, match="counts"):
        masked_values([torch.ones(2)], [torch.ones(2, dtype=torch.bool)], [1, 2])


def _reading_callback(tried: list[str], losses: list[float], shares: list[float]) -> Any:
    """A user's callback with ``device_update = True``: a value computed on the device read at the fit's end
    (``on_host``), the training loss tried in ``on_client_fit_end`` and read in ``on_before_aggregate``."""
    from pl_fedsparse.callbacks import FederatedCallback

    class Reads(FederatedCallback):
        device_update = True

        def on_client_fit_end(self, loop: Any, module: Any, update: ClientUpdate) -> None:
            try:
                float(update.metrics["train_loss"])
                tried.append("a number")
            except TypeError as e:
                tried.append(str(e))
            w = next(iter(update.state.values()))
            share = (w > 0).float().mean()  # (where the update is: nothing read yet)
            update.on_host([share], lambda host: update.extras.update(positive_share=float(host[0])))

        def on_before_aggregate(self, loop: Any, updates: Any) -> None:
            losses.extend(u.metrics["train_loss"] for u in updates)
            shares.extend(u.extras["positive_share"] for u in updates)

    return Reads()


@pytest.mark.parametrize("device", [False, True])
def test_a_users_callback_reads_on_the_host_what_it_computed_on_the_device(tmp_path: Any, device: bool) -> None:
    import contextlib

    from conftest import tiny_datamodule, tiny_loop, tiny_module

    from pl_fedsparse.testing import simulated_device

    tried: list[str] = []
    losses: list[float] = []
    shares: list[float] = []
    loop = tiny_loop(tmp_path, callbacks=[_reading_callback(tried, losses, shares)], num_rounds=1)
    with simulated_device() if device else contextlib.nullcontext():
        loop.fit(tiny_module(), tiny_datamodule())
    assert tried and all("is read when the fit ends" in t and "device_update" in t for t in tried), tried
    assert losses and all(isinstance(x, float) and 0 < x < 10 for x in losses), losses
    assert shares and all(isinstance(x, float) and 0 < x < 1 for x in shares), shares


def test_without_the_device_update_the_loss_is_a_number_in_the_hook(tmp_path: Any) -> None:
    """A callback that takes host copies (no ``device_update``): the loss is read before the callbacks, as ever."""
    from conftest import tiny_datamodule, tiny_loop, tiny_module

    from pl_fedsparse.callbacks import FederatedCallback

    seen: list[Any] = []

    class OnHost(FederatedCallback):
        def on_client_fit_end(self, loop: Any, module: Any, update: ClientUpdate) -> None:
            seen.append(update.metrics["train_loss"])

    tiny_loop(tmp_path, callbacks=[OnHost()], num_rounds=1).fit(tiny_module(), tiny_datamodule())
    assert seen and all(isinstance(x, float) for x in seen), seen


def _own_metrics_module(as_tensors: bool) -> Any:
    """:func:`tiny_module` with its own ``fit_metrics``: the loss sum kept on the device, returned as a 0-dim tensor
    (read with the update's copy) or as a float (read when training ends: a wait on a device)."""
    from conftest import tiny_module

    from pl_fedsparse.module import FederatedModule

    class OwnMetrics(FederatedModule):
        def on_fit_start(self) -> None:
            super().on_fit_start()
            self.loss_sum, self.seen = torch.zeros(()), 0

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = super().training_step(batch, batch_idx)
            self.loss_sum = self.loss_sum.to(loss.device) + loss.detach() * batch[1].shape[0]
            self.seen += int(batch[1].shape[0])
            return loss

        def fit_metrics(self) -> dict[str, Any]:
            mean = self.loss_sum / max(self.seen, 1)
            return {"train_loss": mean if as_tensors else float(mean), "samples_seen": self.seen}

    plain = tiny_module()
    module = OwnMetrics(plain.backbone, lr=plain.lr)
    return module


@pytest.mark.parametrize("device_update", [False, True])
def test_a_modules_fit_metrics_may_be_tensors_read_with_the_update(tmp_path: Any, device_update: bool) -> None:
    """``fit_metrics`` returning 0-dim tensors where the fit ran: read with the update's one copy to the host (no
    wait for the device), the same numbers as returned as floats; a callback that takes the update on the host sees
    floats in ``on_client_fit_end``, as the protocol promised before."""
    from conftest import tiny_datamodule, tiny_loop

    from pl_fedsparse.callbacks import FederatedCallback
    from pl_fedsparse.testing import simulated_device

    seen: list[Any] = []

    class Sees(FederatedCallback):
        def on_client_fit_end(self, loop: Any, module: Any, update: ClientUpdate) -> None:
            seen.append(update.metrics["train_loss"])

    Sees.device_update = device_update
    rows = {}
    for as_tensors in (True, False):
        seen.clear()
        loop = tiny_loop(tmp_path / str(as_tensors), callbacks=[Sees()], num_rounds=2)
        with simulated_device():
            loop.fit(_own_metrics_module(as_tensors), tiny_datamodule())
        rows[as_tensors] = [(r["train_loss"], r["flops_train"]) for r in loop.history]
        if not device_update:
            assert seen and all(isinstance(x, float) for x in seen), seen
        assert all(isinstance(r["train_loss"], float) for r in loop.history)
    assert rows[True] == rows[False]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_gather_and_the_loss_stack_make_no_synchronising_call() -> None:
    """CUDA's own check (``torch.cuda.set_sync_debug_mode("error")``): ``masked_values`` at host-known counts and
    the loss's stack for the update's copy never read a device value on the host; the values are ``t[m]``'s."""
    from pl_fedsparse.functional.sparse import masked_values

    g = torch.Generator(device="cuda").manual_seed(0)
    ts = [torch.randn(64, 27, device="cuda", generator=g), torch.randn(10, device="cuda", generator=g)]
    ms = [torch.rand(64, 27, device="cuda", generator=g) < 0.3, torch.ones(10, dtype=torch.bool, device="cuda")]
    counts = [int(m.sum()) for m in ms]
    want = [t[m] for t, m in zip(ts, ms)]
    s = StepLosses()
    for i in range(5):
        s.add(ts[1][i] ** 2, 8)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = masked_values(ts, ms, counts)
        read = s.pending()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert read is not None
    stacked, total_of = read
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert total_of(stacked.cpu()) == s.total()


def test_reads_left_by_an_executor_that_ends_fits_its_own_way_are_made_when_the_loop_takes_them(
        tmp_path: Any) -> None:
    """A user's executor that returns updates without ``end_fit``: what ``on_host`` put off is read when the loop
    takes the update (a wait then, on a device), so no placeholder reaches the round's numbers."""
    from conftest import tiny_datamodule, tiny_loop, tiny_module

    from pl_fedsparse.executors import InProcessExecutor

    class Leaves(InProcessExecutor):
        def run(self, requests: Any) -> list[ClientUpdate]:
            out = super().run(requests)
            for u in out:
                u.metrics["late"] = PendingMetric("late")
                u.on_host([torch.tensor([3.0])], lambda host, u=u: u.metrics.update(late=float(host[0][0])))
            return out

    seen: list[Any] = []
    from pl_fedsparse.callbacks import FederatedCallback

    class Reads(FederatedCallback):
        def on_before_aggregate(self, loop: Any, updates: Any) -> None:
            seen.extend(u.metrics["late"] for u in updates)

    loop = tiny_loop(tmp_path, callbacks=[Reads()], num_rounds=1, executor=Leaves())
    loop.fit(tiny_module(), tiny_datamodule())
    assert seen and all(x == 3.0 for x in seen), seen
