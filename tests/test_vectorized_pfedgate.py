"""pFedGate under the VectorizedExecutor: a round's gated fits stacked (the gates, the knapsacks, θ' and the model's
step for all clients at once) give the in-process run — the stacked pieces against the one-client functions, whole
runs against the in-process executor's (accuracies, losses and gate densities to 1e-5, bytes and FLOPs exactly), the
kept gate state and momentum equal; and the settings it does not stack refused in one line or run in process."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tiny_datamodule, tiny_loop, tiny_module
from test_vectorized import _cli_run, _rows, assert_same_run, one_thread  # noqa: F401 (autouse fixture)
from torch import Tensor

from pl_fedsparse import FederatedCallback
from pl_fedsparse.callbacks import KeepOptimizerState, PFedGate
from pl_fedsparse.errors import ConfigError
from pl_fedsparse.executors import VectorizedExecutor, VectorizedFitHooks
from pl_fedsparse.functional.gate import adapt_gated_weights, block_table, code_s_min, personalized_params
from pl_fedsparse.functional.gate_stacked import (
    stacked_gate_forward,
    stacked_personalized_params,
    stacked_select_blocks,
    stacked_straight_through,
)
from pl_fedsparse.models import LeNetCIFAR
from pl_fedsparse.models.gate import GatingLayer

ROOT = Path(__file__).resolve().parent.parent


# ---- the stacked pieces against one client's ------------------------------------------------------------------
def _gates(k: int, separate: bool, num_blocks: int) -> list[GatingLayer]:
    out = []
    for i in range(k):
        torch.manual_seed(i)
        g = GatingLayer(num_blocks, 3, 32, separate_paths=separate)
        with torch.no_grad():  # every client's gate its own
            for p in g.parameters():
                p.add_(torch.randn_like(p) * 0.1)
            for name, b in g.named_buffers():
                if b.is_floating_point():
                    b.add_(torch.rand_like(b))
        out.append(g)
    return out


@pytest.mark.parametrize("separate", [False, True])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("variant", ["paper", "code"])
def test_the_stacked_gated_step_is_each_clients_own(separate: bool, training: bool, variant: str) -> None:
    """G, M, the kept blocks, M', the running statistics and the gradients of θ and the gates, for 4 clients with
    their own gates and budgets (one dense), against GatingLayer, adapt_gated_weights and personalized_params of
    each client alone: the same selections, values to 1e-6 (the gate's sigmoid rounds differently in the stacked
    layout), θ's gradients bit for bit."""
    torch.manual_seed(0)
    model = LeNetCIFAR(num_classes=10)
    table = block_table(model)
    K, B = 4, 6
    gates = _gates(K, separate, table.num_blocks)
    x = torch.randn(K, B, 3, 32, 32)
    dens = [0.5, 0.3, 1.0, 0.5]
    floors = [code_s_min(5, d) for d in dens]
    names = dict(gates[0].named_parameters())
    state = {n: torch.stack([g.state_dict()[n] for g in gates]).clone() for n in gates[0].state_dict()}
    for n, t in state.items():
        if n in names:
            t.requires_grad_()
    imp, w = stacked_gate_forward(state, x, torch.tensor(floors), training=training, separate_paths=separate)
    keep = stacked_select_blocks(imp, table, dens)
    m_sparse = stacked_straight_through(keep, imp, w, variant, torch.tensor([d >= 1 for d in dens]))
    theta = {n: torch.stack([p.detach()] * K).clone().requires_grad_() for n, p in model.named_parameters()}
    target = {n: torch.randn_like(t) for n, t in theta.items()}
    tp = stacked_personalized_params(theta, m_sparse, table)
    loss = sum(((tp[n] - target[n]) ** 2).sum() for n in tp)
    leaves = [t for n, t in state.items() if n in names]
    grads = torch.autograd.grad(loss, [*theta.values(), *leaves])
    scale = max(float(g.abs().max()) for g in grads[len(theta):])
    for k in range(K):
        gate = copy.deepcopy(gates[k]).train(training)
        th = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
        i1, w1 = gate(x[k], s_min=floors[k])
        m1, keep1 = adapt_gated_weights(i1, w1, table, dens[k], variant=variant)
        assert torch.equal(keep[k], keep1), k
        torch.testing.assert_close(imp[k], i1, rtol=0, atol=1e-6)
        torch.testing.assert_close(w[k], w1, rtol=0, atol=1e-6)
        torch.testing.assert_close(m_sparse[k], m1, rtol=0, atol=1e-6)
        for n, b in gate.state_dict().items():  # the running statistics moved as the module's own
            torch.testing.assert_close(state[n][k].detach().double(), b.double(), rtol=1e-6, atol=1e-7)
        tp1 = personalized_params(th, m1, table)
        loss1 = sum(((tp1[n] - target[n][k]) ** 2).sum() for n in tp1)
        # (the code variant at density 1 uses M alone: path A then has no gradient, zero in the stacked rows)
        ref = [torch.zeros_like(t) if r is None else r for t, r in zip(
            [*th.values(), *gate.parameters()],
            torch.autograd.grad(loss1, [*th.values(), *gate.parameters()], allow_unused=True), strict=True)]
        for g, r in zip(grads[:len(theta)], ref[:len(theta)], strict=True):
            torch.testing.assert_close(g[k], r, rtol=1e-5, atol=1e-6)
        for g, r in zip(grads[len(theta):], ref[len(theta):], strict=True):
            torch.testing.assert_close(g[k], r, rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize("separate", [False, True])
def test_batches_of_different_sizes_stack_as_each_clients_own(separate: bool) -> None:
    """Clients' batches of 6, 3, 1 and 5 samples padded to 6: G, M, the running statistics and the gates' gradients
    against each client's gate on its own batch alone (the client of one sample in eval mode, as a lone gate runs),
    to rounding."""
    table = block_table(LeNetCIFAR(num_classes=10))
    sizes = [6, 3, 1, 5]
    K, B = len(sizes), max(sizes)
    gates = _gates(K, separate, table.num_blocks)
    x = torch.randn(K, B, 3, 32, 32)
    names = dict(gates[0].named_parameters())
    state = {n: torch.stack([g.state_dict()[n] for g in gates]).clone() for n in gates[0].state_dict()}
    for n, t in state.items():
        if n in names:
            t.requires_grad_()
    imp, w = stacked_gate_forward(state, x, 0.2, training=True, separate_paths=separate, sizes=sizes)
    weights = torch.randn(K, table.num_blocks)
    leaves = [t for n, t in state.items() if n in names]
    grads = torch.autograd.grad((imp * weights).sum() + (w * weights).sum(), leaves)
    # (to float32 rounding of the gate's Linear over d_X = 3,072 inputs: a batched product against a client's own
    # addmm, whose blocking — and so rounding — depends on the CPU's vector width; over a client's 3 samples the
    # batch variance shows it at ~2e-6 on an AVX-512 machine. A statistic over the padded rows is off by ~1e-1)
    tol = 1e-5
    for k, n_k in enumerate(sizes):
        gate = copy.deepcopy(gates[k]).train(n_k >= 2)
        i1, w1 = gate(x[k, :n_k], s_min=0.2)
        torch.testing.assert_close(imp[k], i1, rtol=0, atol=tol)
        torch.testing.assert_close(w[k], w1, rtol=0, atol=tol)
        for n, b in gate.state_dict().items():
            torch.testing.assert_close(state[n][k].detach().double(), b.double(), rtol=tol, atol=tol, msg=n)
        ref = torch.autograd.grad((i1 * weights[k]).sum() + (w1 * weights[k]).sum(), list(gate.parameters()),
                                  allow_unused=True)
        for n, g, r in zip(names, grads, ref, strict=True):
            r = torch.zeros_like(g[k]) if r is None else r
            # (an entry summed with cancellation rounds at the scale of the tensor's largest, not of its own value)
            torch.testing.assert_close(g[k], r, rtol=1e-4, atol=max(1e-6, tol * float(r.abs().max())), msg=n)


def test_stacked_selection_is_each_clients_own_knapsack_on_many_draws() -> None:
    """300 random importance rows (with ties: values on a grid of tenths), 5 budgets, both budgets' groupings."""
    from pl_fedsparse.functional import gate as gate_fn

    table = block_table(LeNetCIFAR(num_classes=10))
    gen = torch.Generator().manual_seed(0)
    for budget in ("group", "global"):
        dens = [0.25, 0.3, 0.5, 0.8, 1.0] * 60
        imp = torch.randint(0, 11, (len(dens), table.num_blocks), generator=gen).float() / 10
        imp += torch.rand(imp.shape, generator=gen) * 0.04 - 0.02
        got = stacked_select_blocks(imp, table, dens, budget)
        for k, d in enumerate(dens):
            want = gate_fn.select_blocks(imp[k], table, d, budget=budget)
            assert torch.equal(got[k], want), (budget, k, d)


# ---- whole runs ------------------------------------------------------------------------------------------------
def _kept(loop: Any) -> dict[tuple[int, str, str], Tensor]:
    """Every client's stored gate, gate momentum and θ momentum entries."""
    out = {}
    for key in loop.client_store.keys:
        for k in range(loop.datamodule.num_clients):
            if loop.client_store.has(k, key):
                for name, t in loop.client_store.get(k, key).items():
                    out[(k, key, name)] = t
    return out


def _assert_same_state(ref: dict[tuple[int, str, str], Tensor], got: dict[tuple[int, str, str], Tensor]) -> None:
    assert ref.keys() == got.keys() and ref
    for key, t in ref.items():
        assert got[key].dtype == t.dtype and got[key].shape == t.shape, key
        # rounding of the stacked arithmetic (checked per step to 1e-6 above) grows over a run's gate steps: within
        # 5e-4 of each tensor's scale (measured: at most 1.5e-4, a gate's second path after 8 steps at lr 0.5), and
        # 1e-6 for the input norm's bias, whose gradient is a cancellation's rounding (its values ~1e-9)
        scale = float(t.double().abs().max()) if t.numel() else 0.0
        torch.testing.assert_close(got[key].double(), t.double(), rtol=0, atol=5e-4 * scale + 1e-6, msg=str(key))


def _single_sample_batch_size(dm_kw: dict[str, Any]) -> int:
    """A batch size at which one client's last batch holds one sample (the gate then steps nothing)."""
    dm = tiny_datamodule(**dm_kw)
    dm.setup("fit")
    sizes = [dm.num_samples(k) for k in range(dm.num_clients)]
    for bs in range(5, 40):
        if any(n % bs == 1 for n in sizes) and len({-(-n // bs) for n in sizes}) > 1:
            return bs
    raise AssertionError(sizes)


@pytest.mark.parametrize("gate_kw", [
    {},
    {"separate_paths": True, "straight_through": "code", "aggregation": "ewa", "relu_logits": True},
    {"client_densities": [0.3, 0.5, 1.0], "budget": "global", "aggregation": "fedavg", "gate_momentum": 0.0},
    {"schedule": "bilevel", "separate_paths": True},
    {"solver": "exact", "client_densities": [0.3, 0.5, 1.0]},
], ids=["index-momentum", "two-paths-code-ewa", "mixed-budgets-global", "bilevel", "exact-knapsack"])
def test_stacked_pfedgate_gives_the_in_process_run(tmp_path: Path, gate_kw: dict[str, Any]) -> None:
    """Clients of different sizes (different step counts; one client's last batch a single sample, which steps
    nothing), half the clients a round (groups mix clients with kept momentum and fresh ones), two epochs, both
    clips, the milestone decay of both learning rates, groups of 3: the same rounds, and every client's stored gate,
    gate momentum and θ momentum equal. The bilevel schedule: each client's gate trains in its first epoch, its
    model in its second (at one step, clients of different sizes in different phases). The exact knapsack (Eq. 6,
    its global budget) per client on the host."""
    dm_kw = {"alpha": 0.1, "quantity_skew": True, "num_clients": 6}
    bs = _single_sample_batch_size(dm_kw)

    def run(executor: Any, sub: str) -> tuple[list[dict], dict[tuple[int, str, str], Tensor]]:
        gate = PFedGate(**{"density": 0.5, "aggregation": "index", "gate_lr": 0.5, "lr_milestones": [0.5],
                           **gate_kw})
        loop = tiny_loop(tmp_path / sub, callbacks=[gate, KeepOptimizerState()], executor=executor, num_rounds=4,
                         local_epochs=2, gradient_clip_val=0.5, join_ratio=0.5)
        loop.fit(tiny_module(momentum=0.9, weight_decay=5e-4), tiny_datamodule(batch_size=bs, **dm_kw))
        return _rows(loop), _kept(loop)

    (ref, ref_state), (got, got_state) = run(None, "ref"), run(VectorizedExecutor(max_group_size=3), "vec")
    assert_same_run(ref, got)
    _assert_same_state(ref_state, got_state)
    assert any(r.get("gate_density_train") for r in got)


@pytest.mark.slow
@pytest.mark.parametrize("config", ["cifar10_pfedgate", "cifar10_pfedgate_hetero", "cifar10_pfedgate_novel"])
def test_the_pfedgate_paper_configs_shrunk_give_the_in_process_run(tmp_path: Path, config: str) -> None:
    """The paper's configs (LeNet-CIFAR, all clients every round, the code's settings; heterogeneous budgets; novel
    clients, whose gate-only fine-tuning runs in process and is counted in the round's row) on 32×32 synthetic
    images: the same run stacked."""
    argv = ["--config", str(ROOT / "configs" / f"{config}.yaml"), "--data.name", "synthetic", "--data.root",
            "null", "--data.num_clients", "6", "--data.batch_size", "16", "--data.synthetic",
            '{"num_train": 360, "num_test": 80, "size": 32, "channels": 3}', "--trainer.num_rounds", "3",
            "--trainer.eval_every", "1"]
    ref, got = _cli_run(tmp_path / "ref", argv, False), _cli_run(tmp_path / "vec", argv, True)
    in_process = [r.pop("sequential_fits", 0) for r in got]
    assert (sum(in_process) > 0) == config.endswith("novel")
    assert_same_run(ref, got)


# ---- the protocol's new parts, on their own -----------------------------------------------------------------------
class _InFit(FederatedCallback):
    """A callback with an in-fit hook and a vectorised form given at construction."""

    def __init__(self, form: Any) -> None:
        self.form = form

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        pass

    def vectorized_fit(self) -> Any:
        return self.form


class _Computes(VectorizedFitHooks):
    def gradients(self, *args: Any, **kwargs: Any) -> None:
        return None


class _Refuses(VectorizedFitHooks):
    def supports(self, context: Any) -> bool:
        return False


def test_two_callbacks_that_compute_the_gradients_are_refused_in_one_line(tmp_path: Path) -> None:
    loop = tiny_loop(tmp_path, callbacks=[PFedGate(density=0.5), _InFit(_Computes())], executor=VectorizedExecutor())
    with pytest.raises(ConfigError, match=r"^trainer.callbacks is invalid .*PFedGate, _InFit each compute") as e:
        loop.fit(tiny_module(), tiny_datamodule())
    assert "\n" not in str(e.value)


def test_a_fit_a_form_does_not_support_runs_in_process(tmp_path: Path) -> None:
    """``supports`` False: every fit in process (the same numbers, bit for bit), counted in the round's row."""
    ref = tiny_loop(tmp_path / "ref", callbacks=[_InFit(_Refuses())])
    ref.fit(tiny_module(), tiny_datamodule())
    got = tiny_loop(tmp_path / "vec", callbacks=[_InFit(_Refuses())], executor=VectorizedExecutor())
    got.fit(tiny_module(), tiny_datamodule())
    rows = _rows(got)
    assert [r.pop("sequential_fits") for r in rows] == [r["num_participants"] for r in _rows(ref)]
    assert rows == _rows(ref)


class _RaggedWithoutGradients(VectorizedFitHooks):
    """Says it takes batches of different sizes, then leaves the step to the executor: a broken form."""

    ragged = True

    def gradients(self, *args: Any, **kwargs: Any) -> None:
        return None


def test_padded_batches_never_reach_the_modules_own_loss(tmp_path: Path) -> None:
    """A form that takes ragged batches but returns no gradients for them: the padded batch is not trained on as if
    it were real (the group is re-run in process, said in the row), so the run is the in-process one."""
    dm_kw = {"alpha": 0.1, "quantity_skew": True, "batch_size": 7}
    ref = tiny_loop(tmp_path / "ref", callbacks=[_InFit(_RaggedWithoutGradients())])
    ref.fit(tiny_module(), tiny_datamodule(**dm_kw))
    got = tiny_loop(tmp_path / "vec", callbacks=[_InFit(_RaggedWithoutGradients())], executor=VectorizedExecutor())
    got.fit(tiny_module(), tiny_datamodule(**dm_kw))
    rows = _rows(got)
    assert all(r.pop("sequential_fits") == r["num_participants"] for r in rows)
    assert rows == _rows(ref)
