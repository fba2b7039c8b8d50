"""The top-level callbacks/ examples work from the repository root, by class_path."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import fit_rows

from pl_fedsparse.cli import main

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # the examples are imported as `callbacks.<file>`, as pl-fed does from the repo root
    sys.path.insert(0, str(REPO))


def test_trimmed_mean_drops_outliers() -> None:
    from callbacks.trimmed_mean import trimmed_mean

    vals = [torch.tensor([1.0, -50.0]), torch.tensor([2.0, 0.0]), torch.tensor([3.0, 1.0]),
            torch.tensor([1000.0, 2.0]), torch.tensor([2.0, 1.0])]
    torch.testing.assert_close(trimmed_mean(vals, 0.2), torch.tensor([7 / 3, 2 / 3]))
    torch.testing.assert_close(trimmed_mean(vals, 0.0), torch.stack(vals).mean(0))


@pytest.mark.slow
def test_trimmed_mean_config_runs_from_repo_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(REPO)
    rows = fit_rows(["--config", "configs/synthetic_trimmed_mean.yaml", "--trainer.num_rounds", "2",
                     "--data.num_clients", "10", "--trainer.default_root_dir", str(tmp_path / "run")], capsys)
    assert rows[-1]["round"] == 1 and rows[-1]["acc_mean"] > 0.1


def test_trimmed_mean_rejects_bad_trim() -> None:
    from callbacks.trimmed_mean import TrimmedMean
    from pl_fedsparse import ConfigError

    with pytest.raises(ConfigError, match="TrimmedMean.trim=0.5"):
        TrimmedMean(trim=0.5)


def test_movement_prune_drops_weights_that_shrank(tmp_path: Path) -> None:
    from callbacks.movement_prune import MovementPrune
    from pl_fedsparse import ClientUpdate

    cb = MovementPrune(density=0.5)

    class L:
        global_state = {"w": torch.tensor([1.0, 1.0, 1.0, 0.0])}

    mask = torch.tensor([True, True, True, False])
    up = ClientUpdate(0, 0, 1, {"w": torch.tensor([2.0, 0.5, 3.0, 0.0])}, masks={"w": mask})
    score = cb.drop_score(L(), up, "w", up.state["w"])
    # entry 1 shrank (1 -> 0.5) and has the lowest score although entry 0/2 would also survive magnitude pruning
    assert int(score[:3].argmin()) == 1


@pytest.mark.slow
def test_movement_prune_config_runs_from_repo_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(REPO)
    run = tmp_path / "run"
    code = main(["fit", "--config", "configs/synthetic_movement_prune.yaml", "--trainer.num_rounds", "2",
                 "--data.num_clients", "10", "--trainer.default_root_dir", str(run)])
    assert code == 0, capsys.readouterr().err
    s = json.loads((run / "summary.json").read_text())
    mlp_params = 768 * 200 + 200 + 200 * 200 + 200 + 200 * 10 + 10  # MLP on 3x16x16, hidden [200, 200]
    dense_bytes = 2 * 5 * 2 * 4 * mlp_params  # 2 rounds x 5 clients x (down + up) x 4 B
    assert s["comm_cum_bytes_total"] < 0.75 * dense_bytes  # sparse messages at density 0.5


_SMALL = ["--trainer.num_rounds", "2", "--data.num_clients", "8", "--trainer.enable_progress_bar", "false"]
_COMPARED = ("acc_mean", "acc_weighted", "global_acc", "loss_mean", "train_loss", "comm_cum_bytes_total",
             "flops_train_cum")


@pytest.mark.slow
def test_fedprox_mu_zero_is_fedavg_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(REPO)
    runs = {}
    for name, cfg, extra in [("avg", "configs/synthetic_fedavg.yaml", []),
                             ("prox0", "configs/synthetic_fedprox.yaml", ["--trainer.callbacks.init_args.mu", "0"]),
                             ("prox", "configs/synthetic_fedprox.yaml", ["--trainer.callbacks.init_args.mu", "0.5"])]:
        runs[name] = fit_rows(["--config", cfg, *_SMALL, *extra, "--trainer.default_root_dir", str(tmp_path / name)],
                              capsys)
    for a, b in zip(runs["avg"], runs["prox0"]):
        assert {k: a[k] for k in _COMPARED} == {k: b[k] for k in _COMPARED}
    assert runs["prox"][-1]["loss_mean"] != runs["avg"][-1]["loss_mean"]  # μ > 0 changes training


def test_fedprox_regularises_only_training_fits(tmp_path: Path) -> None:
    from conftest import tiny_datamodule, tiny_loop, tiny_module

    from callbacks.fedprox import FedProx
    from pl_fedsparse import current_fit
    from pl_fedsparse.callbacks import FineTune

    kinds: list[str] = []

    class Spy(FedProx):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):  # type: ignore[no-untyped-def]
            kinds.append(f"{current_fit().kind}:{bool(self.anchor)}")  # type: ignore[union-attr]
            super().on_before_optimizer_step(trainer, pl_module, optimizer)

    loop = tiny_loop(tmp_path, num_rounds=1, callbacks=[Spy(mu=0.1), FineTune(epochs=1)])
    loop.fit(tiny_module(), tiny_datamodule())
    assert "train:True" in kinds and "finetune:False" in kinds
    assert set(kinds) == {"train:True", "finetune:False"}


def test_snip_masks_are_the_saliency_top_k_at_the_initial_weights(tmp_path: Path) -> None:
    """Every client's mask — also of clients never sampled — is the top |g ⊙ w| of one local batch at the initial
    weights, computed independently here; its gradient pass is charged."""
    from conftest import tiny_datamodule, tiny_loop, tiny_module

    from callbacks.snip import SnipMask
    from pl_fedsparse.functional import layer_densities

    cb = SnipMask(density=0.5)
    loop = tiny_loop(tmp_path, num_rounds=1, clients_per_round=1, callbacks=[cb])
    loop.fit(tiny_module(), tiny_datamodule())
    ref, dm = tiny_module(), tiny_datamodule()
    dm.setup("fit")
    dens = layer_densities(cb.shapes, 0.5, "erk")
    sampled = set(loop.select_clients(0))
    assert len(sampled) == 1
    for k in range(4):
        x, y = next(iter(dm.train_loader(k, seed=loop.streams.seed("snip", 0, k))))
        ref.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        for name, p in ref.named_parameters():
            if dens[name] < 1:
                sal = (p.grad * p.detach()).abs().flatten()
                keep = int(dens[name] * p.numel())
                expect = torch.zeros(p.numel(), dtype=torch.bool)
                expect[torch.argsort(sal, descending=True, stable=True)[:keep]] = True
                assert torch.equal(cb.masks(loop, k)[name], expect.view(p.shape)), (k, name)
    batch = 16  # tiny_datamodule's batch size
    one_fit = loop.history[0]["flops_train"]
    assert loop.accounting.flops_cum == pytest.approx(one_fit + 4 * batch * loop.accounting.flops_per_sample())


@pytest.mark.slow
def test_snip_config_runs_from_repo_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(REPO)
    rows = fit_rows(["--config", "configs/synthetic_snip_fedspa.yaml", *_SMALL,
                     "--trainer.default_root_dir", str(tmp_path / "run")], capsys)
    assert rows[-1]["acc_mean"] > 0.1


def test_examples_are_small_and_use_no_private_attributes() -> None:
    import ast

    for name in ("fedprox.py", "snip.py"):
        tree = ast.parse((REPO / "callbacks" / name).read_text())
        code_lines = set()
        for node in ast.walk(tree):
            is_doc = isinstance(node, ast.Expr) and isinstance(getattr(node, "value", None), ast.Constant)
            if isinstance(node, ast.stmt) and not is_doc and not isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                code_lines.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
        assert len(code_lines) < 40, (name, len(code_lines))
        private = [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr.startswith("_")]
        assert not private, (name, private)
