"""A fit's training loss kept per step and summed when the fit ends (:class:`~pl_fedsparse.metrics.StepLosses`): the
very number the per-step sum on the device gave, bit for bit, for every dtype and both ways of summing, with no
operator per step."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pl_fedsparse.metrics import StepLosses


def _module_sum(losses: list[torch.Tensor], sizes: list[int]) -> float:
    """FederatedModule's former per-step sum: ``acc = zeros(()); acc += loss.detach() * n``."""
    acc = torch.zeros(())
    for t, n in zip(losses, sizes):
        acc += t.detach() * n
    return float(acc)


def _meter_sum(losses: list[torch.Tensor], sizes: list[int]) -> float:
    """FitMeter's former per-step sum: ``value = loss.detach().float() * n``, summed from the first value."""
    acc = None
    for t, n in zip(losses, sizes):
        value = t.detach().float() * n
        acc = value if acc is None else acc + value
    assert acc is not None
    return float(acc)


def _draw(rng: random.Random, dtype: torch.dtype, steps: int) -> tuple[list[torch.Tensor], list[int]]:
    values = [rng.choice([rng.uniform(0, 5), rng.uniform(0, 1e-3), rng.expovariate(0.2)]) for _ in range(steps)]
    return [torch.tensor(v, dtype=dtype) for v in values], [rng.choice([1, 7, 32, 64, 128, 500]) for _ in values]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_the_sum_at_the_end_is_the_per_step_sum_bit_for_bit(dtype: torch.dtype) -> None:
    rng = random.Random(str(dtype))
    for _ in range(60):
        losses, sizes = _draw(rng, dtype, rng.randint(1, 120))
        module, meter = StepLosses(), StepLosses(cast_float=True, start_at_zero=False)
        for t, n in zip(losses, sizes):
            module.add(t, n)
            meter.add(t, n)
        assert module.total() == _module_sum(losses, sizes)
        assert meter.total() == _meter_sum(losses, sizes)
        assert module.samples == meter.samples == sum(sizes) and len(module) == len(sizes)


def test_edge_values_sum_as_on_the_device() -> None:
    """Non-finite losses, an overflowing sum, a first loss of -0.0, a one-element loss of shape [1], no step."""
    cases = [[float("nan"), 1.0], [float("inf"), 2.0], [3e38, 3e38], [-0.0], [-0.0, 0.0], [1e-45, 2.5]]
    for values in cases:
        losses, sizes = [torch.tensor(v) for v in values], [3] * len(values)
        for s, ref in ((StepLosses(), _module_sum), (StepLosses(cast_float=True, start_at_zero=False), _meter_sum)):
            for t, n in zip(losses, sizes):
                s.add(t, n)
            assert repr(s.total()) == repr(ref(losses, sizes)), values
    shaped = StepLosses()
    shaped.add(torch.tensor([0.5]), 2)
    assert shaped.total() == 1.0
    assert StepLosses().total() is None and StepLosses().samples == 0


def test_adding_a_step_runs_no_operator_and_the_end_reads_once() -> None:
    """No operator per step (the device sum cost two); at the end one stacking, then one read on the host."""
    ops: list[str] = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if not func.is_view:
                ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    losses = [torch.tensor(0.1 * i) for i in range(50)]
    s = StepLosses()
    with Count():
        for t in losses:
            s.add(t, 8)
    assert ops == []
    with Count():
        total = s.total()
    assert ops.count("stack") + ops.count("cat") == 1 and len([o for o in ops if o not in ("_to_copy",
                                                                                         "_local_scalar_dense")]) <= 1
    assert math.isclose(total, sum(0.1 * i * 8 for i in range(50)), rel_tol=1e-6)


def test_a_module_and_a_meter_report_the_loss_they_always_did(tmp_path: Any) -> None:
    """A federation's ``train_loss`` through FederatedModule (its own ``fit_metrics``) and through a module without
    one (FitMeter) equals the sum recomputed the former way from the same steps' losses."""
    from conftest import tiny_datamodule, tiny_module

    from pl_fedsparse.executors.base import FitMeter
    from pl_fedsparse.executors.runner import FitRunner

    module, dm = tiny_module(), tiny_datamodule()
    dm.setup()
    returned: list[tuple[torch.Tensor, int]] = []
    train = type(module).training_step

    def spy(self: Any, batch: Any, batch_idx: int) -> Any:
        loss = train(self, batch, batch_idx)
        returned.append((loss.detach().clone(), int(batch[1].shape[0])))
        return loss

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(module), "training_step", spy)
        meter = FitMeter()
        FitRunner(torch.device("cpu")).fit(module, dm.train_loader(0, seed=1), [meter], max_epochs=2, max_steps=-1)
    losses, sizes = [t for t, _ in returned], [n for _, n in returned]
    n = sum(sizes)
    assert module.fit_metrics() == {"train_loss": _module_sum(losses, sizes) / n, "samples_seen": float(n)}
    assert meter.metrics() == {"train_loss": _meter_sum(losses, sizes) / n, "samples_seen": float(n)}
