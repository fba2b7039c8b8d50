"""VectorizedExecutor: a stage's fits trained together give the in-process executor's run (accuracies and losses to
1e-5, bytes and FLOPs exactly), contain faulty clients, resume, and refuse in one line what they cannot vectorise."""

from __future__ import annotations

import contextlib
import ctypes
import io
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import METHODS, InFitProbe, tiny_datamodule, tiny_loop, tiny_module
from torch import Tensor

from pl_fedsparse import FederatedCallback, FederatedModule, allocator
from pl_fedsparse.callbacks import KeepOptimizerState, PersonalLayers
from pl_fedsparse.cli import FedCLI
from pl_fedsparse.errors import ConfigError
from pl_fedsparse.executors import VectorizedExecutor, VectorizedFitHooks
from pl_fedsparse.models import MLP

ROOT = Path(__file__).resolve().parent.parent
TIMES = ("time_s", "time_cum_s", "time_train_s")
#: compared exactly (integers: bytes, links, counts; FLOPs are exact products)
EXACT_PREFIXES = ("comm_", "flops_", "num_participants", "client_faults", "round", "evaluated")
#: synthetic configs whose callbacks have in-fit hooks without a vectorised form, and the one they name
#: the CIFAR-10 CPU configs of the serverless baselines, shrunk onto the synthetic task (as benchmarks/parity.py)
SHRINK = ["--data.name", "synthetic", "--data.root", "null", "--data.num_clients", "6", "--data.max_train_samples",
          "null", "--data.augment", "false", "--data.batch_size", "32", "--data.synthetic", '{"num_train": 1200}',
          "--model.backbone", "pl_fedsparse.models.MLP", "--model.backbone.init_args.num_classes", "10",
          "--model.backbone.init_args.in_channels", "3", "--model.backbone.init_args.input_size", "16",
          "--trainer.local_epochs", "1", "--trainer.eval_every", "1"]


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _rows(loop: Any) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in TIMES} for row in loop.history]


def assert_same_run(ref: list[dict], got: list[dict], tol: float = 1e-5, relative: bool = False) -> None:
    """Accuracies, losses and other floats within ``tol`` (``relative``: ``tol`` of the value where it is above 1);
    bytes, FLOPs and counts exactly; the same keys."""
    assert len(ref) == len(got)
    for a, b in zip(ref, got, strict=True):
        assert a.keys() == b.keys(), (a.keys() ^ b.keys())
        for k, va in a.items():
            vb = b[k]
            if k.startswith(EXACT_PREFIXES) or not isinstance(va, float):
                assert va == vb, (a["round"], k, va, vb)
            elif math.isnan(va):
                assert math.isnan(vb), (a["round"], k, va, vb)
            else:
                assert abs(va - vb) <= tol * (max(1.0, abs(va)) if relative else 1.0), (a["round"], k, va, vb)


def _cli_run(tmp: Path, argv: list[str], executor: bool) -> list[dict]:
    return _rows(_cli_fit(tmp, argv, executor))


def _cli_fit(tmp: Path, argv: list[str], executor: bool, accelerator: str = "cpu") -> Any:
    """The federation of ``argv`` fitted (``executor``: by the VectorizedExecutor), for its rows and state."""
    args = [*argv, "--trainer.default_root_dir", str(tmp), "--trainer.logger", "false",
            "--trainer.enable_progress_bar", "false", "--trainer.accelerator", accelerator]
    if executor:
        args += ["--trainer.executor", "pl_fedsparse.executors.VectorizedExecutor"]
    with contextlib.redirect_stdout(io.StringIO()):
        cli = FedCLI(args=args, run=False)
        cli.trainer.fit(cli.model, cli.datamodule)
    return cli.trainer


SYNTHETIC = sorted(p.stem for p in (ROOT / "configs").glob("synthetic_*.yaml"))


@pytest.mark.parametrize("name", SYNTHETIC)
@pytest.mark.slow
def test_every_supported_synthetic_config_gives_the_in_process_run(tmp_path: Path, name: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # callbacks.* (the FedProx example) import from the repository root
    argv = ["--config", f"configs/{name}.yaml", "--trainer.num_rounds", "3", "--trainer.eval_every", "1"]
    ref = _cli_run(tmp_path / "ref", argv, executor=False)
    got = _cli_run(tmp_path / "vec", argv, executor=True)
    assert_same_run(ref, got)


def _images32(num_train: int = 64) -> list[str]:
    """4 clients, all training every round, on 32×32 RGB synthetic images, batches of 8."""
    return ["--data.name", "synthetic", "--data.root", "null", "--data.num_clients", "4", "--data.max_train_samples",
            "null", "--data.augment", "false", "--data.batch_size", "8", "--data.synthetic",
            f'{{"num_train": {num_train}, "num_test": 32, "size": 32, "channels": 3}}', "--trainer.join_ratio", "1.0"]


#: the papers' backbones (FedSpa's VGG11-GN, DisPFL's ResNet18-GN, DM-PFL's and FedPSE's McMahan CNN, pFedGate's
#: LeNet, the FEMNIST CNN) on 32×32 RGB synthetic images
PAPER_BACKBONES = [["pl_fedsparse.models.VGG11GN"], ["pl_fedsparse.models.ResNet18GN"],
                   ["pl_fedsparse.models.McMahanCNN", "--model.backbone.init_args.in_channels", "3",
                    "--model.backbone.init_args.input_size", "32"],
                   ["pl_fedsparse.models.LeNetCIFAR"],
                   ["pl_fedsparse.models.CNNFEMNIST", "--model.backbone.init_args.num_classes", "10",
                    "--model.backbone.init_args.in_channels", "3", "--model.backbone.init_args.input_size", "32"]]


@pytest.mark.parametrize("backbone", PAPER_BACKBONES, ids=lambda b: b[0].rsplit(".", 1)[1])
@pytest.mark.slow
def test_the_papers_models_give_the_in_process_run(tmp_path: Path, backbone: list[str]) -> None:
    """Convolutions and GroupNorm over stacked clients: the same run as one client at a time, to float rounding
    (1e-5 of the value); FedAvg, so that no top-k selection can turn a last-bit difference into another mask."""
    argv = ["--config", str(ROOT / "configs" / "cifar10_fedavg.yaml"), *_images32(),
            "--model.backbone", *backbone, "--model.lr", "0.01", "--trainer.local_epochs", "1",
            "--trainer.eval_every", "1", "--trainer.num_rounds", "2"]
    assert_same_run(_cli_run(tmp_path / "ref", argv, False), _cli_run(tmp_path / "vec", argv, True), relative=True)


@pytest.mark.parametrize("backbone", [PAPER_BACKBONES[0], PAPER_BACKBONES[3]], ids=["VGG11GN", "LeNetCIFAR"])
@pytest.mark.slow
def test_grouped_convolutions_give_the_in_process_run_to_float_tolerance(tmp_path: Path,
                                                                         backbone: list[str]) -> None:
    """``convolutions: grouped`` (one grouped convolution for every client: other rounding than a client's own)
    still gives the in-process run to 1e-5 of the value over two FedAvg rounds."""
    argv = ["--config", str(ROOT / "configs" / "cifar10_fedavg.yaml"), *_images32(),
            "--model.backbone", *backbone, "--model.lr", "0.01", "--trainer.local_epochs", "1",
            "--trainer.eval_every", "1", "--trainer.num_rounds", "2"]
    executor = '{"class_path": "pl_fedsparse.executors.VectorizedExecutor", "init_args": {"convolutions": "grouped"}}'
    grouped = [*argv, "--trainer.executor", executor]
    assert_same_run(_cli_run(tmp_path / "ref", argv, False), _cli_run(tmp_path / "vec", grouped, False), relative=True)


def test_convolutions_must_be_per_client_or_grouped() -> None:
    with pytest.raises(ConfigError, match=r"VectorizedExecutor.convolutions='each' is invalid: expected one of "
                                          r"per_client, grouped"):
        VectorizedExecutor(convolutions="each")  # type: ignore[arg-type]


@pytest.mark.slow
def test_fedspa_on_vgg11_gives_the_in_process_run(tmp_path: Path) -> None:
    """FedSpa's own setting in miniature: masked VGG11-GN with prune-and-regrow — stacked masks, GroupNorm and top-k
    together give the in-process run to rounding."""
    argv = ["--config", str(ROOT / "configs" / "cifar10_fedspa_dst_cpu.yaml"), *_images32(32),
            "--model.backbone", "pl_fedsparse.models.VGG11GN", "--model.lr", "0.01", "--trainer.local_epochs", "1",
            "--trainer.eval_every", "1", "--trainer.num_rounds", "2"]
    assert_same_run(_cli_run(tmp_path / "ref", argv, False), _cli_run(tmp_path / "vec", argv, True), relative=True)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.slow
def test_a_model_whose_stacked_gradients_disagree_is_refused_in_one_line(tmp_path: Path, precision: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the executor's own GroupNorm rule, ``vmap``'s (torch 2.14.1) gives ResNet18-GN gradients up to ~3e-3
    off a client's own — the in-process run drifts away within a round — and the executor refuses the model at its
    first stacked step; under ``bf16-mixed`` too (the check runs in float32, where bfloat16's rounding cannot hide a
    wrong rule)."""
    from pl_fedsparse.executors import stacked

    monkeypatch.setattr(stacked, "_stacked_group_norm", stacked._GROUP_NORM)
    argv = ["--config", str(ROOT / "configs" / "cifar10_fedavg.yaml"), *_images32(),
            "--model.backbone", "pl_fedsparse.models.ResNet18GN", "--trainer.num_rounds", "1",
            "--trainer.precision", precision]
    with pytest.raises(ConfigError, match=r"VectorizedExecutor cannot train model=FederatedModule \(backbone "
                                          r"ResNet18GN\): its stacked gradients differ from one client's own by "):
        _cli_run(tmp_path, argv, True)


@pytest.mark.parametrize("backbone", [PAPER_BACKBONES[1], PAPER_BACKBONES[0]], ids=["ResNet18GN", "VGG11GN"])
@pytest.mark.slow
def test_bf16_mixed_on_the_papers_group_norm_models_gives_the_in_process_run(tmp_path: Path,
                                                                             backbone: list[str]) -> None:
    """Under autocast the stacked layers cast their arguments as autocast casts one client's (linear layers and
    convolutions to bfloat16, GroupNorm as the device runs it): the same run as in process, to the training loss's
    float sum, and at one thread the global weights bit for bit — where ``vmap``'s own rules (GroupNorm's wrong
    backward, batched products in another precision) part from it."""
    argv = ["--config", str(ROOT / "configs" / "cifar10_fedavg.yaml"), *_images32(),
            "--model.backbone", *backbone, "--model.lr", "0.01", "--trainer.local_epochs", "1",
            "--trainer.eval_every", "1", "--trainer.num_rounds", "2", "--trainer.precision", "bf16-mixed"]
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # (bits at one thread: with more, a batched product may split its work otherwise)
    try:
        ref, got = _cli_fit(tmp_path / "ref", argv, False), _cli_fit(tmp_path / "vec", argv, True)
    finally:
        torch.set_num_threads(before)
    assert_same_run(_rows(ref), _rows(got), relative=True)
    assert ref.global_state.keys() == got.global_state.keys()
    assert all(torch.equal(t, got.global_state[n]) for n, t in ref.global_state.items())


def test_the_gradient_check_sees_a_wrong_batching_rule() -> None:
    """Planted: a stacked gradient off by 1 % in one client (a wrong rule) is caught; rounding is not."""
    from pl_fedsparse.executors.stacked import STACKED_GRADIENT_TOLERANCE, stacked_gradient_error

    torch.manual_seed(0)
    w = torch.randn(3, 5)
    params, xs, ys = {"w": torch.stack([w, w])}, torch.randn(2, 4, 5), torch.randint(0, 3, (2, 4))

    def loss(p: dict, f: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(x @ p["w"].t(), y)

    good = torch.func.vmap(torch.func.grad(loss))(params, {}, xs, ys)
    assert stacked_gradient_error(loss, params, {}, xs, ys, good)[0] < STACKED_GRADIENT_TOLERANCE
    bad = {"w": good["w"].clone()}
    bad["w"][1] *= 1.01
    err, name = stacked_gradient_error(loss, params, {}, xs, ys, bad)
    assert err > STACKED_GRADIENT_TOLERANCE and name == "w"


def test_the_gradient_check_runs_in_ieee_float32(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both sides of the check are computed with TF32 off (on a GPU cuDNN convolves in TF32 by default, and its
    rounding put VGG11-GN's stacked and alone gradients 5.4e-4 apart on an H100), and the user's setting is back
    for training: recorded at the check and at every later stacked step."""
    import pl_fedsparse.executors.vectorized as vec
    from pl_fedsparse.executors.stacked import full_fp32, stacked_gradient_error

    conv, matmul = torch.backends.cudnn.conv, torch.backends.cuda.matmul
    before = (conv.fp32_precision, matmul.fp32_precision)
    seen: list[tuple[str, str]] = []

    def recording(*args: Any, **kwargs: Any) -> tuple[float, str]:
        seen.append((conv.fp32_precision, matmul.fp32_precision))
        return stacked_gradient_error(*args, **kwargs)

    monkeypatch.setattr(vec, "stacked_gradient_error", recording)
    conv.fp32_precision = "tf32"
    try:
        tiny_loop(tmp_path, executor=VectorizedExecutor(), num_rounds=1).fit(tiny_module(), tiny_datamodule())
        assert seen == [("ieee", "ieee")]
        assert conv.fp32_precision == "tf32"  # restored
        with pytest.raises(RuntimeError), full_fp32():
            raise RuntimeError("inside")
        assert conv.fp32_precision == "tf32"  # restored after an exception too
    finally:
        conv.fp32_precision, matmul.fp32_precision = before


@pytest.mark.parametrize(("name", "rounds"), [("dpsgd_cpu", 3), ("dpsgd_ft_cpu", 3), ("ditto_cpu", 3), ("feddst_cpu", 3),
                                             ("fedspa_dst_cpu", 3), ("fedspa_rsm_cpu", 3), ("local_p2p_cpu", 3),
                                             ("dmpfl_plus_cpu", 5)])
@pytest.mark.slow
def test_paper_method_configs_shrunk_onto_the_synthetic_task_give_the_in_process_run(tmp_path: Path, name: str,
                                                                                     rounds: int) -> None:
    argv = ["--config", str(ROOT / "configs" / f"cifar10_{name}.yaml"), *SHRINK, "--trainer.num_rounds", str(rounds)]
    assert_same_run(_cli_run(tmp_path / "ref", argv, False), _cli_run(tmp_path / "vec", argv, True))


def test_unvectorisable_callbacks_can_run_in_process_instead(tmp_path: Path) -> None:
    def make() -> list[Any]:
        return [InFitProbe(), KeepOptimizerState()]

    ref = tiny_loop(tmp_path / "ref", callbacks=make(), local_epochs=2)
    ref.fit(tiny_module(), tiny_datamodule())
    got = tiny_loop(tmp_path / "vec", callbacks=make(), local_epochs=2,
                    executor=VectorizedExecutor(unsupported="sequential"))
    got.fit(tiny_module(), tiny_datamodule())
    assert _rows(got) == _rows(ref)  # the same code path: bit for bit


def _fedprox() -> list[Any]:
    import sys

    if str(ROOT) not in sys.path:  # the example is imported as `callbacks.fedprox`, as pl-fed does from the root
        sys.path.insert(0, str(ROOT))
    from callbacks.fedprox import FedProx

    return [FedProx(mu=0.5)]


RAGGED = {**{m: v for m, v in METHODS.items() if m != "pfedgate"}, "fedprox": (_fedprox, None)}


@pytest.mark.parametrize("method", list(RAGGED))
def test_ragged_clients_and_per_client_learning_rates(tmp_path: Path, method: str) -> None:
    """Clients of different sizes (different step counts and last batches: once the smaller ones stop, a step holds
    only the others' rows), 2 epochs, clipping, a learning rate that changes every round, SGD with momentum: the
    same run."""
    make, topo = RAGGED[method]

    def run(executor: Any, sub: str) -> list[dict]:
        loop = tiny_loop(tmp_path / sub, callbacks=make(), executor=executor, topology=topo() if topo else None,
                         num_rounds=3, local_epochs=2, gradient_clip_val=0.5)
        dm = tiny_datamodule(alpha=0.1, batch_size=7, quantity_skew=True)
        loop.fit(tiny_module(momentum=0.9, lr_decay=0.7, weight_decay=5e-4), dm)
        sizes = {dm.num_samples(k) for k in range(dm.num_clients)}
        assert len(sizes) == dm.num_clients  # every client a different number of steps and a different last batch
        return _rows(loop)

    assert_same_run(run(None, "ref"), run(VectorizedExecutor(max_group_size=3), "vec"))


def test_adam_and_weight_decay_and_local_steps(tmp_path: Path) -> None:
    def run(executor: Any, sub: str) -> list[dict]:
        loop = tiny_loop(tmp_path / sub, executor=executor, num_rounds=3, local_steps=5)
        loop.fit(tiny_module(optimizer="adam", lr=0.01, weight_decay=1e-3), tiny_datamodule(batch_size=9))
        return _rows(loop)

    assert_same_run(run(None, "ref"), run(VectorizedExecutor(), "vec"))


def _kept_states(loop: Any) -> dict[tuple[int, str], Tensor]:
    """Every client's kept optimizer entries, by (client, key)."""
    key = next(k for k in loop.client_store.keys if k.startswith("KeepOptimizerState"))
    out = {}
    for k in range(loop.datamodule.num_clients):
        if loop.client_store.has(k, key):
            for name, t in loop.client_store.get(k, key).items():
                out[(k, name)] = t
    return out


class Dampened(FederatedModule):
    """SGD with momentum and dampening: a fresh buffer's first step is the gradient itself, a kept one's is damped."""

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, dampening=0.3)


@pytest.mark.parametrize("variant", ["sgd", "sgd-dampening-kept", "personal-lr", "fedavg-first", "adam",
                                     "adam-kept"])
def test_fedrep_alternating_epochs_stacked_give_the_in_process_run(tmp_path: Path, variant: str) -> None:
    """FedRep stacked: clients of different sizes (at one step some train the head, others the body), momentum and
    weight decay on a frozen part, gradient clipping, half the clients a round: the same rows and, at one thread, the
    same global and personal weights bit for bit. With dampening and kept momenta, a frozen part's buffer must not
    start until its first real step (SGD's first step takes the gradient itself); with a first FedAvg round, that
    round's fits train every layer. With Adam (weight decay; kept moments and counts), each tensor's bias corrections
    count its own steps — the head's and the body's differ — and a frozen row's moments stay as they were."""

    def run(executor: Any, sub: str) -> tuple[list[dict], Any]:
        callbacks: list[Any] = [PersonalLayers(mode="fedrep", head_epochs=1,
                                               personal_lr=0.03 if variant == "personal-lr" else None,
                                               fedavg_rounds=1 if variant == "fedavg-first" else 0)]
        if variant.endswith("-kept"):
            callbacks.append(KeepOptimizerState())
        loop = tiny_loop(tmp_path / sub, callbacks=callbacks, executor=executor, num_rounds=3, local_epochs=3,
                         gradient_clip_val=0.5, join_ratio=0.5)
        torch.manual_seed(0)
        if variant == "sgd-dampening-kept":
            module: FederatedModule = Dampened(_mlp())
        elif variant.startswith("adam"):
            module = FederatedModule(_mlp(), optimizer="adam", lr=0.01, weight_decay=5e-3)
        else:
            module = FederatedModule(_mlp(), lr=0.1, momentum=0.9, weight_decay=5e-3)
        loop.fit(module, tiny_datamodule(alpha=0.1, quantity_skew=True))
        return _rows(loop), loop

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        (ref, ref_loop), (got, got_loop) = run(None, "ref"), run(VectorizedExecutor(), "vec")
    finally:
        torch.set_num_threads(before)
    assert_same_run(ref, got)
    assert all(torch.equal(t, got_loop.global_state[n]) for n, t in ref_loop.global_state.items())
    key = next(k for k in ref_loop.client_store.keys if k.startswith("PersonalLayers"))
    for k in range(ref_loop.datamodule.num_clients):
        mine, theirs = ref_loop.client_store.get(k, key), got_loop.client_store.get(k, key)
        assert all(torch.equal(t, theirs[n]) for n, t in mine.items()), k
    assert "sequential_fits" not in got[-1]


@pytest.mark.parametrize("variant", ["plain", "milestones-kept-momentum", "bf16-mixed"])
def test_fedem_stacked_gives_the_in_process_run(tmp_path: Path, variant: str) -> None:
    """FedEM stacked: every client's E-step from its own mixture weights and received components, the components'
    weighted loss, its new π — clients of different sizes (shorter last batches), half the clients a round, two
    epochs; with learning-rate milestones and kept momenta; under bf16-mixed. The same rows, each client's π and
    the global components to float rounding (1e-5 of the value; bf16: to bfloat16's)."""
    from pl_fedsparse.callbacks import FedEM
    from pl_fedsparse.models import Mixture

    def run(executor: Any, sub: str) -> tuple[list[dict], Any]:
        callbacks: list[Any] = [FedEM(num_components=3, lr_milestones=[0.5] if variant != "plain" else None)]
        if variant == "milestones-kept-momentum":
            callbacks.append(KeepOptimizerState())
        loop = tiny_loop(tmp_path / sub, callbacks=callbacks, executor=executor, num_rounds=4, local_epochs=2,
                         join_ratio=0.5, precision="bf16-mixed" if variant == "bf16-mixed" else "32-true")
        torch.manual_seed(0)
        module = FederatedModule(Mixture(_mlp(), 3), lr=0.1, momentum=0.9 if variant != "plain" else 0.0)
        loop.fit(module, tiny_datamodule(alpha=0.1, batch_size=7, quantity_skew=True))
        return _rows(loop), loop

    (ref, ref_loop), (got, got_loop) = run(None, "ref"), run(VectorizedExecutor(), "vec")
    tol = 2e-2 if variant == "bf16-mixed" else 1e-5
    assert_same_run(ref, got, tol=tol, relative=True)
    assert "sequential_fits" not in got[-1]
    for n, t in ref_loop.global_state.items():
        torch.testing.assert_close(got_loop.global_state[n], t, rtol=tol, atol=tol)
    key = next(k for k in ref_loop.client_store.keys if k.startswith("FedEM"))
    for k in range(ref_loop.datamodule.num_clients):
        torch.testing.assert_close(got_loop.client_store.get(k, key), ref_loop.client_store.get(k, key),
                                   rtol=tol, atol=tol)


class SgdOnlyProbe(InFitProbe):
    """An in-fit callback whose vectorised form takes SGD only (its ``optimizers`` attribute)."""

    def vectorized_fit(self) -> Any:
        class Form(VectorizedFitHooks):
            optimizers = ("sgd",)

        return Form()


def test_a_form_that_takes_other_optimizers_is_refused_in_one_line(tmp_path: Path) -> None:
    loop = tiny_loop(tmp_path, callbacks=[SgdOnlyProbe()], executor=VectorizedExecutor())
    with pytest.raises(ConfigError, match=r"^trainer.callbacks is invalid with trainer.executor=VectorizedExecutor: "
                                          r"SgdOnlyProbe has a vectorised form for sgd only, the module's optimizer "
                                          r"is adam \(run it in process"):
        loop.fit(tiny_module(optimizer="adam", lr=0.01), tiny_datamodule())
    assert not any((tmp_path).rglob("*.ckpt"))
    loop = tiny_loop(tmp_path / "sgd", callbacks=[SgdOnlyProbe()], executor=VectorizedExecutor())
    loop.fit(tiny_module(), tiny_datamodule())  # (SGD: stacked, none in process)
    assert "sequential_fits" not in loop.history[-1]


@pytest.mark.parametrize("optimizer", ["sgd", "sgd-dampening", "adam"])
def test_kept_optimizer_state_continues_in_stacked_fits(tmp_path: Path, optimizer: str) -> None:
    """KeepOptimizerState under stacked fits: half the clients a round (so a group mixes clients with kept state and
    clients without), clients of different sizes (some stop early), two epochs: the same run, and every client's
    kept momentum (Adam: moments and step count) equal to the one-by-one run's."""

    def run(executor: Any, sub: str) -> tuple[list[dict], dict[tuple[int, str], Tensor]]:
        loop = tiny_loop(tmp_path / sub, callbacks=[KeepOptimizerState()], executor=executor, num_rounds=4,
                         local_epochs=2, gradient_clip_val=0.5, join_ratio=0.5)
        if optimizer == "sgd-dampening":
            torch.manual_seed(0)
            module: FederatedModule = Dampened(_mlp())
        else:
            kw: dict[str, Any] = ({"momentum": 0.9, "weight_decay": 5e-4} if optimizer == "sgd"
                                  else {"optimizer": "adam", "lr": 0.01})
            module = tiny_module(**kw)
        loop.fit(module, tiny_datamodule(alpha=0.1, batch_size=7, quantity_skew=True))
        return _rows(loop), _kept_states(loop)

    (ref, ref_state), (got, got_state) = run(None, "ref"), run(VectorizedExecutor(max_group_size=3), "vec")
    assert_same_run(ref, got)
    assert ref_state.keys() == got_state.keys() and ref_state
    for key, t in ref_state.items():
        assert got_state[key].dtype == t.dtype and got_state[key].shape == t.shape, key
        assert torch.allclose(got_state[key], t, rtol=1e-5, atol=1e-6), key


def test_bf16_mixed_autocasts_like_lightning(tmp_path: Path) -> None:
    def run(executor: Any, sub: str) -> list[dict]:
        loop = tiny_loop(tmp_path / sub, executor=executor, num_rounds=2, precision="bf16-mixed")
        loop.fit(tiny_module(), tiny_datamodule())
        return _rows(loop)

    ref, got = run(None, "ref"), run(VectorizedExecutor(), "vec")
    assert_same_run(ref, got)  # (the stacked linear layers cast as autocast casts one client's: its own products)
    assert ref[-1]["flops_train_cum"] == got[-1]["flops_train_cum"]


class PoisonClient(FederatedCallback):
    """Client 1's start weights become NaN in round 1: its fit is faulty, the others of its group are not."""

    def on_client_fit_start(self, loop: Any, module: Any, context: Any) -> None:
        if context.client_idx == 1 and context.round_idx == 1:
            with torch.no_grad():
                next(module.parameters()).fill_(float("nan"))


def test_a_nan_client_in_a_group_is_contained(tmp_path: Path) -> None:
    def run(executor: Any, sub: str) -> Any:
        loop = tiny_loop(tmp_path / sub, callbacks=[PoisonClient()], executor=executor, num_rounds=3)
        loop.fit(tiny_module(), tiny_datamodule())
        return loop

    ref, got = run(None, "ref"), run(VectorizedExecutor(), "vec")
    assert got.history[1]["client_faults"] == 1
    assert got.history[1]["client_fault_kinds"][0]["client"] == 1
    assert_same_run(_rows(ref), _rows(got))


class FailInStep(FederatedCallback):
    """A vectorised form that raises inside the stacked step once: the group re-runs in process."""

    scratch_attributes = ("raised",)  # the test's own counter, not federation state

    def __init__(self) -> None:
        self.raised = [0]  # in place: attributes a fit sets are put back (per-fit state is per client)

    def vectorized_fit(self) -> Any:
        owner = self

        class Hooks:
            def capture(self, index: int, module: Any, context: Any) -> None: ...

            def start(self, fit: Any) -> None: ...

            def before_optimizer_step(self, fit: Any) -> None:
                if fit.contexts[0].round_idx == 1 and owner.raised[0] == 0:
                    owner.raised[0] += 1
                    raise RuntimeError("boom")

            def after_optimizer_step(self, fit: Any) -> None: ...

        return Hooks()


def test_an_exception_in_a_stacked_step_runs_that_group_in_process(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    ref = tiny_loop(tmp_path / "ref", num_rounds=3)
    ref.fit(tiny_module(), tiny_datamodule())
    cb = FailInStep()
    got = tiny_loop(tmp_path / "vec", callbacks=[cb], executor=VectorizedExecutor(), num_rounds=3)
    with caplog.at_level(logging.WARNING):
        got.fit(tiny_module(), tiny_datamodule())
    assert cb.raised == [1] and "run in process" in caplog.text
    assert got.history[1]["sequential_fits"] == 4 and got.history[1]["client_faults"] == 0
    assert_same_run([{k: v for k, v in r.items() if k != "sequential_fits"} for r in _rows(got)], _rows(ref))


def test_resume_gives_the_uninterrupted_run(tmp_path: Path) -> None:
    from conftest import fit_until_interrupted

    make = METHODS["dispfl"][0]
    full = tiny_loop(tmp_path / "full", callbacks=make(), executor=VectorizedExecutor(), topology=METHODS["dispfl"][1](),
                     num_rounds=4)
    full.fit(tiny_module(), tiny_datamodule())
    cut = tiny_loop(tmp_path / "cut", callbacks=make(), executor=VectorizedExecutor(), topology=METHODS["dispfl"][1](),
                    num_rounds=4)
    fit_until_interrupted(cut, 2, tiny_module(), tiny_datamodule())
    again = tiny_loop(tmp_path / "cut", callbacks=make(), executor=VectorizedExecutor(),
                      topology=METHODS["dispfl"][1](), num_rounds=4)
    again.fit(tiny_module(), tiny_datamodule(), ckpt_path=str(tmp_path / "cut" / "checkpoints" / "last.ckpt"))
    assert _rows(again)[-2:] == _rows(full)[-2:]


# ---------------------------------------------------------------------------------------------------- refusals
class OwnStep(FederatedModule):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return super().training_step(batch, batch_idx) * 2


class DeclaredStep(FederatedModule):
    """Its own training_step, which is loss(forward(x), y): declared so."""

    vectorizable = True

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        self.log("own_loss", 1.0)  # (outside a fit, as the check runs it: no trainer, no harm)
        return {"loss": self.loss(self(x), y)}


class MisdeclaredStep(OwnStep):
    """Says vectorizable, but its loss is twice loss(forward(x), y)."""

    vectorizable = True


class BatchNormModule(FederatedModule):
    def __init__(self) -> None:
        super().__init__(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 8), torch.nn.BatchNorm1d(8),
                                             torch.nn.Linear(8, 4)))


class DropoutModule(FederatedModule):
    def __init__(self) -> None:
        super().__init__(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 8), torch.nn.Dropout(0.5),
                                             torch.nn.Linear(8, 4)))


class WithScheduler(FederatedModule):
    def configure_optimizers(self) -> Any:
        opt = super().configure_optimizers()
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1)}


class RMSprop(FederatedModule):
    def configure_optimizers(self) -> Any:
        return torch.optim.RMSprop(self.parameters(), lr=0.01)


def _mlp() -> MLP:
    return MLP(num_classes=4, in_channels=1, input_size=8, hidden=[16])


@pytest.mark.parametrize(("module", "kw", "match"), [
    (lambda: OwnStep(_mlp()), {}, r"training_step is its own \(set the class attribute vectorizable = True"),
    (BatchNormModule, {}, r"model=BatchNormModule: backbone.2 \(BatchNorm1d\) keeps batch statistics"),
    (DropoutModule, {}, r"model=DropoutModule: backbone.2 is a dropout layer"),
    (lambda: WithScheduler(_mlp()), {}, r"returns a learning-rate scheduler"),
    (lambda: RMSprop(_mlp()), {}, r"returns RMSprop: the VectorizedExecutor supports torch.optim.SGD"),
    (lambda: FederatedModule(_mlp()), {"precision": "16-mixed"}, r"^trainer.precision='16-mixed' is invalid with"),
])
def test_what_cannot_be_vectorised_is_refused_in_one_line(tmp_path: Path, module: Any, kw: dict, match: str) -> None:
    loop = tiny_loop(tmp_path, executor=VectorizedExecutor(), **kw)
    with pytest.raises(ConfigError, match=match) as e:
        if kw.get("precision") == "16-mixed":  # refused on the CPU before the executor sees it; test the executor
            loop.precision = "16-mixed"
            loop.model = module()
            loop.executor.setup(loop)
        else:
            loop.fit(module(), tiny_datamodule())
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("module", [lambda: WithScheduler(_mlp()), lambda: RMSprop(_mlp())],
                         ids=["scheduler", "rmsprop"])
def test_an_optimizer_it_cannot_stack_is_refused_before_anything_is_written(tmp_path: Path, module: Any) -> None:
    run = tmp_path / "run"
    loop = tiny_loop(run, executor=VectorizedExecutor())
    with pytest.raises(ConfigError):
        loop.fit(module(), tiny_datamodule())
    assert not run.exists() or not any(run.iterdir()), sorted(p.name for p in run.rglob("*"))


def test_a_module_that_declares_its_step_vectorizable_runs(tmp_path: Path) -> None:
    loop = tiny_loop(tmp_path, executor=VectorizedExecutor())
    loop.fit(DeclaredStep(_mlp()), tiny_datamodule())
    assert loop.history[-1]["client_faults"] == 0


def test_a_declaration_its_training_step_does_not_keep_is_refused(tmp_path: Path) -> None:
    """``vectorizable = True`` on a step whose loss is not ``loss(forward(x), y)`` (here twice it): the stacked
    step would train the latter, another run than in process — refused at the first stacked step, in one line."""
    loop = tiny_loop(tmp_path, executor=VectorizedExecutor())
    with pytest.raises(ConfigError, match=r"^trainer.executor=VectorizedExecutor cannot train model=MisdeclaredStep: "
                                          r"it sets vectorizable = True but its training_step's loss \([\d.]+\) is "
                                          r"not loss\(forward\(x\), y\) \([\d.]+\) on a batch"):
        loop.fit(MisdeclaredStep(_mlp()), tiny_datamodule())


def test_a_callback_with_in_fit_hooks_and_no_vectorised_form_is_named(tmp_path: Path) -> None:
    loop = tiny_loop(tmp_path, callbacks=[InFitProbe()], executor=VectorizedExecutor())
    with pytest.raises(ConfigError, match=r"InFitProbe has in-fit hooks \(on_train_batch_end\) and no "
                                          r"vectorized_fit \(give it one, docs/extending.md, or set "
                                          r"VectorizedExecutor.unsupported: sequential\)$"):
        loop.fit(tiny_module(), tiny_datamodule())


@pytest.mark.parametrize(("kw", "match"), [
    ({"max_group_size": 0}, "VectorizedExecutor.max_group_size=0 is invalid"),
    ({"unsupported": "skip"}, "VectorizedExecutor.unsupported='skip' is invalid"),
])
def test_bad_arguments(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        VectorizedExecutor(**kw)


def test_groups_are_equal_and_capped_by_the_largest_tensor_on_the_cpu(tmp_path: Path) -> None:
    sizes: list[int] = []
    ex = VectorizedExecutor()
    real = ex._run_group

    def spy(requests: list[Any]) -> list[Any]:
        sizes.append(len(requests))
        return real(requests)

    ex._run_group = spy  # type: ignore[method-assign]
    loop = tiny_loop(tmp_path, executor=ex, num_rounds=1)
    module = tiny_module()
    client = sum(t.numel() * t.element_size() for t in module.state_dict().values())
    loop.fit(module, tiny_datamodule(num_clients=10))
    assert ex._group_cap() == (256 << 20) // client and sizes == [10]
    sizes.clear()
    ex.max_group_size = 4
    loop2 = tiny_loop(tmp_path / "b", executor=ex, num_rounds=1)
    loop2.fit(tiny_module(), tiny_datamodule(num_clients=10))
    assert sizes == [4, 3, 3]  # three equal-as-can-be groups, not 4 + 4 + 2


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mapped_bytes() -> int | None:
    """glibc's bytes in blocks it mapped on their own (``mallinfo2().hblkhd``); ``None`` where unavailable."""
    libc = allocator._glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _MallInfo2
    return int(libc.mallinfo2().hblkhd)


def test_heap_only_keeps_large_blocks_in_the_heap_and_puts_the_mapping_back(monkeypatch: pytest.MonkeyPatch) -> None:
    if _mapped_bytes() is None:
        pytest.skip("needs glibc >= 2.33 (mallinfo2)")
    big = 96 << 20  # above every mmap threshold
    base = _mapped_bytes()
    with allocator.heap_only() as done:
        assert done is True
        t = torch.empty(big, dtype=torch.uint8)
        assert _mapped_bytes() == base  # from the heap, not a mapping of its own
        del t
    libc = allocator._glibc()
    larger = int(libc.mallinfo2().fordblks) + big  # more than the heap has free: served by a mapping, if allowed
    t = torch.empty(larger, dtype=torch.uint8)
    assert _mapped_bytes() >= base + larger  # mapped again once the scope ends
    del t
    monkeypatch.setenv("PL_FEDSPARSE_MALLOC_TUNING", "0")
    with allocator.heap_only() as done:
        assert done is False


_GPU_CASES = [(["--config", "configs/synthetic_fedspa.yaml"], "32-true"),
              (["--config", "configs/synthetic_pfedgate.yaml"], "32-true"),
              (["--config", str(ROOT / "configs" / "cifar10_fedavg.yaml"), *_images32(),
                "--model.backbone", "pl_fedsparse.models.VGG11GN", "--model.lr", "0.01"], "bf16-mixed")]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
@pytest.mark.parametrize(("argv", "precision"), _GPU_CASES, ids=["fedspa-32", "pfedgate-32", "vgg11gn-bf16"])
def test_on_cuda_stacked_fits_give_the_in_process_run_to_tolerance(tmp_path: Path, argv: list[str], precision: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU (kernels that sum in another order for a batched call, TF32 convolutions): the stacked run counts the
    same bytes and FLOPs as the in-process one on the same GPU and learns alike — VGG11-GN at ``bf16-mixed`` with
    GroupNorm in float32 as CUDA's autocast runs it."""
    monkeypatch.chdir(ROOT)
    args = [*argv, "--trainer.num_rounds", "2", "--trainer.eval_every", "1", "--trainer.precision", precision,
            "--trainer.local_epochs", "1"]
    args += ["--data.device", "cuda"]
    ref, got = (_rows(_cli_fit(tmp_path / tag, args, vec, "gpu")) for tag, vec in (("ref", False), ("vec", True)))
    assert len(ref) == len(got)
    for a, b in zip(ref, got, strict=True):
        for key in ("comm_cum_bytes_total", "flops_train_cum"):
            assert a[key] == b[key], (a["round"], key)
        assert b["acc_mean"] == pytest.approx(a["acc_mean"], abs=0.03), a["round"]
        assert b["loss_mean"] == pytest.approx(a["loss_mean"], rel=0.03), a["round"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
def test_on_cuda_a_stacked_step_waits_for_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the CPU counter says of a stacked step (``device_traffic.py --stacked``: no synchronising call), checked
    by CUDA itself: ``torch.cuda.set_sync_debug_mode`` over the group's stacked training, a run of two local epochs
    against one — the waits a group makes once (the first step's gradient check, the losses read at the end) are
    the same in both, so any difference is a wait per step."""
    import warnings

    from pl_fedsparse.executors import vectorized as vec_mod

    monkeypatch.chdir(ROOT)
    train = vec_mod.VectorizedExecutor._train

    def waits(epochs: int) -> int:
        seen: list[str] = []

        def counted(self: Any, *a: Any, **k: Any) -> Any:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    return train(self, *a, **k)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                    seen.extend(str(w.message) for w in caught if "synchroniz" in str(w.message))

        monkeypatch.setattr(vec_mod.VectorizedExecutor, "_train", counted)
        _cli_fit(tmp_path / str(epochs), ["--config", "configs/synthetic_fedspa.yaml", "--trainer.num_rounds", "2",
                                          "--trainer.local_epochs", str(epochs), "--data.device", "cuda"],
                 True, "gpu")
        return len(seen)

    one, two = waits(1), waits(2)
    assert two == one, (one, two)
