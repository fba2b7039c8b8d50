"""A failed fit leaves its client exactly as it was (docs/usage.md: "the client keeps its previous state").

For every library callback that declares client state, a tiny federation runs with one client's round-1 training fit
failing — NaN weights at the end of the fit (after the optimizer stepped every kept momentum buffer), an exception in
its first step, and an exception at the very end of the fit (after every other callback wrote its client state in
``on_client_fit_end``). Right after the loop took that stage's results back, every declared entry of the client must
equal a deep copy taken before the fit (same keys, ``torch.equal``), and the objects the store held before the fit
must not have been written in place.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conftest import METHODS, tiny_datamodule, tiny_loop, tiny_module

from pl_fedsparse import FederatedCallback, FederatedModule
from pl_fedsparse.callbacks import (
    ElementwiseAggregation,
    FedEM,
    KeepOptimizerState,
    LocalTraining,
    PersonalizedDownstream,
    PersonalLayers,
    TopKUpload,
)
from pl_fedsparse.client import ClientUpdate
from pl_fedsparse.context import FitContext
from pl_fedsparse.contract import CallbackContractError
from pl_fedsparse.executors import FitRequest
from pl_fedsparse.models import MLP, Mixture
from pl_fedsparse.testing import FaultInjection

CLIENT, ROUND = 2, 1


def _mixture_module() -> FederatedModule:
    torch.manual_seed(0)
    return FederatedModule(Mixture(MLP(num_classes=4, in_channels=1, input_size=8, hidden=[16]), 3), lr=0.1,
                           momentum=0.9)


# name -> (callbacks, topology, module); every method keeps each client's optimizer momentum too (momentum > 0)
CASES: dict[str, tuple[Callable[[], list[Any]], Any, Callable[[], pl.LightningModule]]] = {
    **{name: (make, topo, lambda: tiny_module(momentum=0.9)) for name, (make, topo) in METHODS.items()},
    "fedpse": (lambda: [TopKUpload(sparsity=0.8), ElementwiseAggregation(), PersonalizedDownstream(sparsity=0.8),
                        KeepOptimizerState()], None, lambda: tiny_module(momentum=0.9)),
    "fedrep": (lambda: [PersonalLayers(head_epochs=1), KeepOptimizerState()], None,
               lambda: tiny_module(momentum=0.9)),
    "lg_fedavg": (lambda: [PersonalLayers(mode="lg", head_layers=1)], None, lambda: tiny_module(momentum=0.9)),
    "fedem": (lambda: [FedEM(), KeepOptimizerState()], None, _mixture_module),
    "local": (lambda: [LocalTraining(), KeepOptimizerState()], None, lambda: tiny_module(momentum=0.9)),
    "keep_optimizer_state": (lambda: [KeepOptimizerState()], None,
                             lambda: tiny_module(momentum=0.9, weight_decay=1e-3)),
}


class LateFault(FederatedCallback):
    """The fit of ``CLIENT`` in ``ROUND`` raises at its very end, after the callbacks before it stored their state."""

    def on_client_fit_end(self, loop: Any, module: pl.LightningModule, update: ClientUpdate) -> None:
        ctx = update.context
        if ctx is not None and ctx.kind == "train" and ctx.client_idx == CLIENT and ctx.round_idx == ROUND:
            raise RuntimeError("injected fault after on_client_fit_end")


def _clone(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    return tree.clone() if isinstance(tree, torch.Tensor) else tree


def _differences(got: Any, want: Any, name: str = "") -> list[str]:
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return [f"{name}: keys {sorted(got) if isinstance(got, dict) else type(got)} != {sorted(want)}"]
        return [d for k in want for d in _differences(got[k], want[k], f"{name}/{k}")]
    if isinstance(want, torch.Tensor):
        same = (isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape
                and torch.equal(got, want))
        return [] if same else [name]
    return [] if got == want else [name]


def _watch_faulty_fit(loop: Any) -> dict[str, Any]:
    """Wrap ``loop.run_fits``: a deep copy of ``CLIENT``'s state (and the objects themselves) just before the stage
    that holds its round-``ROUND`` training fit, and the store's entries right after the loop took the stage back."""
    seen: dict[str, Any] = {}
    real = loop.run_fits

    def run_fits(requests: Sequence[FitRequest]) -> Any:
        target = [r for r in requests if r.context.client_idx == CLIENT and r.context.kind == "train"
                  and r.context.round_idx == ROUND]
        if not target:
            return real(requests)
        before_refs = loop.client_store.export_client(CLIENT)
        seen["before"], seen["refs"] = _clone(before_refs), before_refs
        updates = real(requests)
        seen["after"] = loop.client_store.export_client(CLIENT)
        seen["faults"] = list(loop.round_faults)
        return updates

    loop.run_fits = run_fits
    return seen


def _faults(kind: str) -> list[Any]:
    if kind == "late_exception":
        return [LateFault()]
    return [FaultInjection(client=CLIENT, rounds=[ROUND], kind=kind)]  # type: ignore[arg-type]


@pytest.mark.parametrize("fault", ["nan_weights", "exception", "late_exception"])
@pytest.mark.parametrize("method", list(CASES))
def test_a_failed_fit_leaves_every_declared_client_state_entry_as_it_was(tmp_path: Path, method: str,
                                                                          fault: str) -> None:
    make, topo, module = CASES[method]
    loop = tiny_loop(tmp_path, num_rounds=ROUND + 1, callbacks=[*make(), *_faults(fault)],
                     topology=topo() if topo else None, local_epochs=2 if method == "fedrep" else 1)
    seen = _watch_faulty_fit(loop)
    loop.fit(module(), tiny_datamodule())
    assert "after" in seen, "the faulty client was not trained in the round"
    assert [f for f in seen["faults"] if f["client"] == CLIENT and f["fit"] == "train"], seen["faults"]
    before, refs, after = seen["before"], seen["refs"], seen["after"]
    declared = [k for k in loop.client_store.keys]
    assert set(before) == set(declared), "every declared entry exists before the fit"
    if method != "fedavg_ft":  # (FineTune declares no entry a train fit touches) the walk covers real state
        assert before
    assert not _differences(after, before), (method, fault, _differences(after, before))
    # the pre-fit objects themselves were not written in place (they may be shared with snapshots, other clients)
    assert not _differences(refs, before), (method, fault, _differences(refs, before))


def test_the_state_of_a_momentum_client_changes_in_a_healthy_fit(tmp_path: Path) -> None:
    # the walk above would pass trivially if nothing were kept: a healthy fit does change the kept momentum
    loop = tiny_loop(tmp_path, num_rounds=ROUND + 1, local_epochs=2,
                     callbacks=[PersonalLayers(head_epochs=1), KeepOptimizerState()])
    seen = _watch_faulty_fit(loop)
    loop.fit(tiny_module(momentum=0.9), tiny_datamodule())
    changed = _differences(seen["after"], seen["before"])
    assert any("KeepOptimizerState" in name for name in changed) and any("PersonalLayers" in n for n in changed)
    assert not _differences(seen["refs"], seen["before"])  # replaced, never written in place


class WritesInPlace(FederatedCallback):
    """Breaks the rule: writes a stored entry in place during a fit (through the store's references)."""

    def setup_federation(self, loop: Any) -> None:
        self.add_client_state(loop, "count", lambda k: torch.zeros(()))

    def on_client_fit_start(self, loop: Any, module: pl.LightningModule, context: FitContext) -> None:
        loop.client_store.stored(context.client_idx, f"{self.client_state_prefix}/count").add_(1)


class ReadsAndSets(FederatedCallback):
    """Keeps the rule: reads (a private copy during a fit), edits that copy in place, sets it back."""

    def setup_federation(self, loop: Any) -> None:
        self.add_client_state(loop, "count", lambda k: {"n": torch.zeros(())})

    def on_client_fit_end(self, loop: Any, module: pl.LightningModule, update: ClientUpdate) -> None:
        value = self.get_client_state(loop, update.client_idx, "count")
        value["n"].add_(1)
        value["extra"] = torch.ones(())
        self.set_client_state(loop, update.client_idx, "count", {"n": value["n"]})


def test_a_stored_entry_written_in_place_during_a_fit_is_reported(tmp_path: Path) -> None:
    loop = tiny_loop(tmp_path, num_rounds=1, callbacks=[WritesInPlace()])
    with pytest.raises(CallbackContractError, match="changed in place"):
        loop.fit(tiny_module(), tiny_datamodule())


def test_a_fit_reads_private_copies_and_only_set_changes_the_store(tmp_path: Path) -> None:
    cb = ReadsAndSets()
    loop = tiny_loop(tmp_path, num_rounds=2, callbacks=[cb])
    loop.fit(tiny_module(), tiny_datamodule())
    for k in range(4):
        assert set(cb.get_client_state(loop, k, "count")) == {"n"}
        assert float(cb.get_client_state(loop, k, "count")["n"]) == 2.0
