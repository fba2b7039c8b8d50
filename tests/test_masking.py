"""SparseMask composed with the plain FedAvg loop: "FedAvg with a static sparse mask"."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TINY_CLI, tiny_datamodule, tiny_loop, tiny_module

from pl_fedsparse import ConfigError, FederatedCallback
from pl_fedsparse.callbacks import SparseMask
from pl_fedsparse.functional import sparse_nbytes


class GrabTrained(FederatedCallback):
    scratch_attributes = ("updates",)  # test records, read in process only

    def __init__(self) -> None:
        self.updates: list = []

    def on_client_fit_end(self, loop, module, update):  # type: ignore[no-untyped-def]
        self.updates.append(update)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_masked_weights_stay_exactly_zero_after_local_fit(tmp_path: Path, precision: str) -> None:
    grab = GrabTrained()
    mask_cb = SparseMask(density=0.3)
    loop = tiny_loop(tmp_path, num_rounds=1, precision=precision, local_epochs=2, callbacks=[mask_cb, grab])
    loop.fit(tiny_module(momentum=0.9, weight_decay=1e-3), tiny_datamodule())
    for up in grab.updates:
        masks = mask_cb.masks(loop, up.client_idx)
        assert masks, "no tensor was masked"
        for name, m in masks.items():
            trained = up.state[name]
            assert torch.count_nonzero(trained[~m]) == 0
            assert torch.count_nonzero(trained[m]) > 0.9 * int(m.sum())


def test_fedavg_with_static_mask_counts_sparse_bytes_and_flops(tmp_path: Path) -> None:
    mask_cb = SparseMask(density=0.5)
    loop = tiny_loop(tmp_path, num_rounds=1, callbacks=[mask_cb])
    summary = loop.fit(tiny_module(), tiny_datamodule())
    masks = mask_cb.masks(loop, 0)
    per_msg = 0
    for name, t in loop.global_state.items():  # type: ignore[union-attr]
        per_msg += sparse_nbytes(t.numel(), int(masks[name].sum())) if name in masks else 4 * t.numel()
    assert summary["comm_cum_bytes_total"] == 2 * 4 * per_msg  # 4 clients, down + up
    # the global model stays sparse under the shared mask, and personal eval uses the masked model
    for name, m in masks.items():
        assert torch.count_nonzero(loop.global_state[name][~m]) == 0  # type: ignore[index]

    dense = tiny_loop(tmp_path / "dense", num_rounds=1)
    dense_summary = dense.fit(tiny_module(), tiny_datamodule())
    assert summary["flops_train_cum"] < 0.8 * dense_summary["flops_train_cum"]
    assert summary["comm_cum_bytes_total"] < 0.8 * dense_summary["comm_cum_bytes_total"]


def test_all_ones_mask_equals_plain_fedavg(tmp_path: Path) -> None:
    masked = tiny_loop(tmp_path / "m", num_rounds=2, callbacks=[SparseMask(density=1.0)])
    masked.fit(tiny_module(), tiny_datamodule())
    plain = tiny_loop(tmp_path / "p", num_rounds=2)
    plain.fit(tiny_module(), tiny_datamodule())
    for k, v in plain.global_state.items():  # type: ignore[union-attr]
        torch.testing.assert_close(masked.global_state[k], v)  # type: ignore[index]


def test_density_out_of_range_is_one_clear_error() -> None:
    with pytest.raises(ConfigError, match=r"SparseMask.density=1.5 is invalid: expected a density in \(0, 1\]"):
        SparseMask(density=1.5)


def test_density_out_of_range_from_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pl_fedsparse.cli import main

    code = main(["fit", *TINY_CLI, "--trainer.callbacks+", "pl_fedsparse.callbacks.SparseMask",
                 "--trainer.callbacks.density", "1.5", "--trainer.default_root_dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2 and err.strip() == "error: SparseMask.density=1.5 is invalid: expected a density in (0, 1]"


@pytest.mark.parametrize(("distribution", "density", "same_mask"), [("erk", 0.5, False), ("uniform", 0.3, True),
                                                                     ("erk", 0.05, False)])
def test_the_sort_free_initial_masks_are_the_sorted_ones(tmp_path: Path, distribution: str, density: float,
                                                          same_mask: bool) -> None:
    """``draw_mask``'s fast path (a randperm prefix) draws exactly the top-k of :meth:`mask_scores`."""
    from pl_fedsparse.callbacks.masking import top_masks

    cb = SparseMask(density=density, distribution=distribution, same_mask=same_mask)
    loop = tiny_loop(tmp_path, callbacks=[cb])
    loop.setup(tiny_module(), tiny_datamodule())
    for k in range(3):
        fast = cb.draw_mask(loop, k)
        slow = top_masks(cb.mask_scores(loop, k), cb.layer_densities(k))
        assert fast.keys() == slow.keys() and fast
        assert all(torch.equal(fast[n], slow[n]) for n in fast), k
    loop.reporter.release()


def _changed_names(new: dict, old: dict) -> list[str]:
    """The names whose mask changed: the callback's two steps (decided on the device, read in one copy)."""
    from pl_fedsparse.callbacks.masking import _differences, _names_of

    names, differs = _differences(new, old)
    return [] if differs is None else _names_of(names, differs)


def test_only_the_masks_a_readjustment_changed_are_sent_again() -> None:
    """``SparseMask.on_client_fit_end`` sends a next mask (``next_mask/<name>``) only where the readjustment changed
    it; which ones changed is decided where the masks are and read on the host once (``_differences``, then
    ``_names_of``), not once a mask: planted, comparing each by ``torch.equal`` would read once a mask."""
    from torch.utils._python_dispatch import TorchDispatchMode

    old = {"a": torch.tensor([True, False, True]), "b": torch.tensor([[True, False], [False, True]]),
           "c": torch.zeros(0, dtype=torch.bool), "d": torch.tensor(True)}
    new = {"a": torch.tensor([True, True, False]), "b": old["b"].clone(), "c": old["c"].clone(),
           "d": torch.tensor(False)}

    class Reads(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func.overloadpacket.__name__ in ("_local_scalar_dense", "equal", "is_nonzero"):
                Reads.n += 1
            return func(*args, **(kwargs or {}))

    with Reads():
        got = _changed_names(new, old)
    assert got == ["a", "d"] and _changed_names({}, {}) == []
    assert Reads.n == 0  # (the answers read by one ``tolist``, which dispatches no read; no ``equal`` a mask)


def test_which_masks_changed_costs_the_same_operators_for_any_number_of_masks() -> None:
    """The masks are compared joined (one comparison, the differences counted per mask), so the operators do not
    grow with the masks; masks of other shapes, dtypes or devices than their old ones are compared one by one, with
    the same answers. Planted: a comparison per mask fails the count."""
    from conftest import count_operators

    g = torch.Generator().manual_seed(0)

    def masks(n: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        old = {f"m{i}": torch.rand(4, 3, generator=g) < 0.5 for i in range(n)}
        new = {k: v.clone() for k, v in old.items()}
        for k in list(new)[::3]:
            new[k][1, 2] = ~new[k][1, 2]
        return new, old

    new, old = masks(9)
    assert _changed_names(new, old) == ["m0", "m3", "m6"]
    mixed_old = {**old, "m1": old["m1"].float()}  # (another dtype: one by one, the same answer)
    assert _changed_names(new, mixed_old) == ["m0", "m3", "m6"]
    wide = {**new, "m2": torch.ones(1, 3, dtype=torch.bool)}  # (a broadcast shape: as torch.ne broadcasts)
    assert _changed_names(wide, {**old, "m2": torch.ones(4, 3, dtype=torch.bool)}) == ["m0", "m3", "m6"]
    a, b = masks(3)
    c, d = masks(30)
    _changed_names(a, b), _changed_names(c, d)  # (each layout's segments are made once and kept: what every later fit pays)
    assert count_operators(lambda: _changed_names(a, b)) == count_operators(lambda: _changed_names(c, d))
