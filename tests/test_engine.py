"""The engine's shape: fit contexts, requested fits, the executor seam, eager client state, accounting, streams, the
gradient-hook fix, and the module boundaries (no method names in the engine, no runtime cycle)."""

from __future__ import annotations

import ast
import copy
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tiny_datamodule, tiny_loop, tiny_module
from lightning.pytorch.plugins.precision import MixedPrecision

from pl_fedsparse import FederatedCallback, FederatedModule, FitRequest, InProcessExecutor, current_fit
from pl_fedsparse.callbacks import Ditto, FineTune, Gossip, RandomRegrow, SparseMask
from pl_fedsparse.context import FitSpec
from pl_fedsparse.streams import STREAM_IDS, Streams, register_stream, stream_seed
from pl_fedsparse.topology import Ring

PKG = Path(__file__).resolve().parents[1] / "pl_fedsparse"


# ---------------------------------------------------------------------------------------------- fit context
class KindSpy(FederatedCallback):
    """Records the context of every fit, at the federation hooks and inside Lightning's hooks."""

    scratch_attributes = ("starts", "inside", "lrs")  # test records, read in process only

    def __init__(self) -> None:
        self.starts: list[tuple[int, int, str]] = []
        self.inside: list[str] = []
        self.lrs: dict[str, float] = {}

    def on_client_fit_start(self, loop, module, context):  # type: ignore[no-untyped-def]
        self.starts.append((context.round_idx, context.client_idx, context.kind))

    def on_train_start(self, trainer, pl_module):  # type: ignore[no-untyped-def]
        ctx = current_fit()
        assert ctx is not None
        self.inside.append(ctx.kind)
        self.lrs[ctx.kind] = trainer.optimizers[0].param_groups[0]["lr"]


@pytest.mark.slow
def test_every_fit_carries_its_kind_and_no_context_outside_fits(tmp_path: Path) -> None:
    spy = KindSpy()
    loop = tiny_loop(tmp_path, num_rounds=2, callbacks=[Ditto(lam=0.1), FineTune(epochs=1), spy])
    loop.fit(tiny_module(), tiny_datamodule())
    kinds = [k for _, _, k in spy.starts]
    assert kinds.count("train") == 8 and kinds.count("personal") == 8  # 4 clients x 2 rounds, Ditto after each
    assert kinds.count("finetune") == 4  # after the last round only
    assert spy.inside == kinds  # current_fit() inside Lightning hooks agrees with the federation hook
    assert current_fit() is None


@pytest.mark.parametrize("lr_mode, expected", [("current", 0.1 * 0.5 ** 1), ("reference", 0.1 / 0.5)])
def test_finetune_learning_rate_option(tmp_path: Path, lr_mode: str, expected: float) -> None:
    spy = KindSpy()
    loop = tiny_loop(tmp_path, num_rounds=2, callbacks=[FineTune(epochs=1, lr=lr_mode), spy])  # type: ignore[arg-type]
    loop.fit(tiny_module(lr_decay=0.5), tiny_datamodule())
    assert spy.lrs["train"] == pytest.approx(0.1 * 0.5 ** 1)  # the last round's training
    assert spy.lrs["finetune"] == pytest.approx(expected)  # DisPFL's code: lr / lr_decay (round -1)


def test_fit_spec_rejects_train_kind() -> None:
    with pytest.raises(ValueError, match="FitSpec.kind='train'"):
        FitSpec(0, "train", {})  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- executor seam
class CopyingReversedExecutor(InProcessExecutor):
    """Runs requests in reverse order with deep copies of everything that travels, as a worker process would."""

    def run(self, requests):  # type: ignore[no-untyped-def]
        shipped = [FitRequest(r.context, {k: v.clone() for k, v in r.start.items()}, copy.deepcopy(r.client_state))
                   for r in requests]
        out = {id(r): self.run_one(r) for r in reversed(shipped)}
        for u in out.values():
            u.client_state = copy.deepcopy(u.client_state)
        return [out[id(r)] for r in shipped]


_METRICS = ("acc_mean", "global_acc", "loss_mean", "train_loss", "comm_cum_bytes_total", "flops_train_cum")


@pytest.mark.parametrize("make", [
    lambda: [RandomRegrow(density=0.5, same_mask=False, mask_personal_eval=False), Gossip()],
    lambda: [SparseMask(density=0.5), Ditto(lam=0.1), FineTune(epochs=1)],
])
def test_an_executor_that_ships_requests_gives_the_same_run(tmp_path: Path, make: Any) -> None:
    rows = []
    for i, executor in enumerate([None, CopyingReversedExecutor()]):
        topo = Ring() if isinstance(make()[-1], Gossip) else None
        loop = tiny_loop(tmp_path / str(i), num_rounds=2, callbacks=make(), executor=executor, topology=topo)
        loop.fit(tiny_module(), tiny_datamodule())
        rows.append([{k: r.get(k) for k in _METRICS} for r in loop.history])
    assert rows[0] == rows[1]


# ---------------------------------------------------------------------------------------------- client state
def test_client_state_exists_for_every_client_when_the_federation_starts(tmp_path: Path) -> None:
    seen: dict[str, Any] = {}

    class Check(FederatedCallback):
        def on_federation_start(self, loop):  # type: ignore[no-untyped-def]
            seen["all"] = all(loop.client_store.has(k, key) for k in range(loop.num_clients)
                              for key in loop.client_store.keys)

    mask = SparseMask(density=0.5, same_mask=False)
    loop = tiny_loop(tmp_path, num_rounds=1, clients_per_round=1, callbacks=[mask, Check()])
    loop.fit(tiny_module(), tiny_datamodule())
    assert seen["all"]
    with pytest.raises(KeyError, match="entries are created when the federation starts"):
        loop.client_store.get(99, mask.client_state_prefix + "/mask")


def test_masks_do_not_depend_on_what_the_module_holds_when_first_read(tmp_path: Path) -> None:
    """A data-dependent mask score reads loop.model: it must see the initial weights for every client, also those
    first evaluated after another model was loaded (the lazy-mask bug)."""
    scored: dict[int, torch.Tensor] = {}

    class WeightScored(SparseMask):
        def mask_scores(self, loop, client_idx):  # type: ignore[no-untyped-def]
            w = dict(loop.model.named_parameters())
            scored[client_idx] = w["backbone.layers.0.weight"].detach().clone()
            return {n: w[n].detach().abs() if n in w else torch.zeros(s) for n, s in self.shapes.items()}

    loop = tiny_loop(tmp_path, num_rounds=2, clients_per_round=1, callbacks=[WeightScored(density=0.5)])
    loop.fit(tiny_module(), tiny_datamodule())
    for k, w in scored.items():
        assert torch.equal(w, loop.initial_state["backbone.layers.0.weight"]), k


# ---------------------------------------------------------------------------------------------- accounting, streams
def test_round_zero_gossip_is_sparse(tmp_path: Path) -> None:
    loop = tiny_loop(tmp_path, num_rounds=2, topology=Ring(),
                     callbacks=[SparseMask(density=0.3, same_mask=False, mask_personal_eval=False), Gossip()])
    loop.fit(tiny_module(), tiny_datamodule())
    per_link = [r["comm_bytes_per_link"] for r in loop.history]
    assert per_link[0] == per_link[1]  # w0 ⊙ m_k in round 0, as in every later round
    dense_bytes = 4 * sum(v.numel() for v in loop.initial_state.values())
    assert per_link[0] < 0.6 * dense_bytes


def test_streams_registry() -> None:
    s = Streams(3)
    assert s.seed("grow", 1, 2) == stream_seed(3, STREAM_IDS["grow"], 1, 2)
    sid = register_stream("tests.my_stream")
    assert sid == register_stream("tests.my_stream") and sid not in (1, 2, 3, 11, 13, 21, 22)
    with pytest.raises(KeyError, match="unknown stream 'nope'"):
        s.seed("nope")


# ---------------------------------------------------------------------------------------------- gradient edits
class ZeroLossModule(FederatedModule):
    """Data gradients are exactly zero: the only gradient is what callbacks add."""

    def loss(self, logits, y):  # type: ignore[no-untyped-def]
        return 0.0 * logits.float().sum()


class ScaledExecutor(InProcessExecutor):
    """Forces 16-mixed with a GradScaler (scale 1024) on CPU, where the loop itself would not allow it."""

    def make_trainer(self, epochs):  # type: ignore[no-untyped-def]
        import lightning.pytorch as pl

        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        return pl.Trainer(accelerator="cpu", devices=1, plugins=[MixedPrecision("16-mixed", "cpu", scaler)],
                          max_epochs=epochs or self.loop.local_epochs, callbacks=self.loop.callbacks,  # type: ignore[union-attr]
                          logger=False, enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)


def _ditto_personal(tmp_path: Path, executor: Any) -> tuple[dict[str, torch.Tensor], Any]:
    ditto = Ditto(lam=0.5)

    class Perturb(FederatedCallback):
        def on_federation_start(self, loop):  # type: ignore[no-untyped-def]
            ditto.set_client_state(loop, 0, "weights", {n: v + 0.25 for n, v in loop.initial_state.items()})

    module = ZeroLossModule(tiny_module().backbone, lr=0.1)
    loop = tiny_loop(tmp_path, num_rounds=1, callbacks=[ditto, Perturb()], executor=executor)
    loop.fit(module, tiny_datamodule(num_clients=1))
    return ditto.get_client_state(loop, 0, "weights"), loop


def test_ditto_term_acts_on_unscaled_gradients(tmp_path: Path) -> None:
    """Ditto's λ(v − wᵗ) is added where gradients are unscaled: the same personal model under 32-true and under
    16-mixed with a loss scale of 1024 (added in on_after_backward, it would be 1024× too weak there)."""
    plain, loop = _ditto_personal(tmp_path / "a", None)
    scaled, _ = _ditto_personal(tmp_path / "b", ScaledExecutor())
    steps = -(-loop.datamodule.num_samples(0, "train") // loop.datamodule.batch_size)
    for name, v in plain.items():
        # v_S − w = (1 − lr·λ)^S (v_0 − w), v_0 − w = 0.25; wᵗ is the initial model (data gradients are zero)
        expected = torch.full_like(v, 0.25 * (1 - 0.1 * 0.5) ** steps)
        torch.testing.assert_close(v - loop.initial_state[name], expected, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(scaled[name], v, rtol=1e-3, atol=1e-5)


# ---------------------------------------------------------------------------------------------- boundaries
ENGINE = ["loop.py", "executors/base.py", "executors/in_process.py", "evaluation.py", "run/writer.py",
          "run/checkpoint.py", "run/directory.py", "streams.py", "context.py", "client.py", "metrics.py", "module.py",
          "topology.py"]
#: method classes (case-sensitive: "finetune" is also a generic fit kind), papers and method-specific metrics
CLASSES = ["DualMask", "FedDST", "Ditto", "FineTune", "Gossip", "LocalTraining", "SparseMask", "AdaptiveInference",
           "ShiftEvaluation", "FedSpaAggregation"]
METHOD_NAMES = ["dm-pfl", "dmpfl", "fedspa", "dispfl", "pfedgate", "fedpse", "adaptive", "shift100", "shift_avg",
                "corruption_avg"]


def _code_words(path: Path) -> str:
    """Identifiers, attribute names and string literals of a module — its code, not its docstrings or comments
    (which cite the papers whose behaviour a default reproduces)."""
    tree = ast.parse(path.read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    words = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            words.append(n.id)
        elif isinstance(n, ast.Attribute):
            words.append(n.attr)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
            words.append(n.value)
    return " ".join(words)


def test_no_engine_module_names_a_method() -> None:
    for name in ENGINE:
        code = _code_words(PKG / name)
        found = [m for m in METHOD_NAMES if re.search(rf"(?<![a-z]){re.escape(m)}(?![a-z])", code.lower())]
        found += [c for c in CLASSES if re.search(rf"(?<![A-Za-z]){c}(?![A-Za-z])", code)]
        assert not found, (name, found)


def _runtime_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    guarded = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
               and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING"
               for n in ast.walk(node)}
    return [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and id(n) not in guarded]


def test_callbacks_do_not_import_the_loop_or_run_fits() -> None:
    for path in sorted((PKG / "callbacks").glob("*.py")) + sorted((PKG.parent / "callbacks").glob("*.py")):
        assert "pl_fedsparse.loop" not in _runtime_imports(path), path.name
        text = path.read_text()
        for call in ("fit_client(", "run_fits(", "fit_request(", "executor.run("):
            assert call not in text, (path.name, call)
