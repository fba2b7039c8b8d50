"""pFedGate's Table 1 baselines the project lacked (issue 11): FedRep and LG-FedAvg (:class:`PersonalLayers`) and
FedEM (:class:`FedEM` with a :class:`Mixture` backbone). The tiny task's MLP is 64 -> 16 -> 4:
``layers.0`` (1024 + 16 values) and ``layers.2`` (64 + 4 values), 1108 values in all."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    TINY_CLI,
    fit_rows,
    fit_until_interrupted,
    one_line,
    run_main,
    tiny_datamodule,
    tiny_loop,
    tiny_module,
)

from pl_fedsparse import ConfigError, FederatedCallback, FederatedModule
from pl_fedsparse.callbacks import FedEM, KeepOptimizerState, PersonalLayers
from pl_fedsparse.callbacks.fedem import WEIGHTS
from pl_fedsparse.callbacks.personal_layers import personal_tensor_names
from pl_fedsparse.functional.mixture import (
    component_log_likelihood,
    e_step,
    m_step_weights,
    mixture_log_prob,
    weighted_nll,
)
from pl_fedsparse.models import MLP, LeNetCIFAR, Mixture

REPO_CONFIGS = Path(__file__).resolve().parents[1] / "configs"
HEAD = ["backbone.layers.2.weight", "backbone.layers.2.bias"]
BODY = ["backbone.layers.0.weight", "backbone.layers.0.bias"]
HEAD_VALUES, BODY_VALUES = 64 + 4, 1024 + 16


def mix_module(seed: int = 0, **kw: Any) -> FederatedModule:
    torch.manual_seed(seed)
    return FederatedModule(Mixture(MLP(num_classes=4, in_channels=1, input_size=8, hidden=[16]), 3),
                           lr=kw.pop("lr", 0.1), **kw)


def rows(run: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


class Traffic(FederatedCallback):
    """Listed after the method: records what is downloaded and uploaded, and every update."""

    scratch_attributes = ("down", "up", "updates")  # test records, read in process only

    def __init__(self) -> None:
        self.down: list[set[str]] = []
        self.up: list[set[str]] = []
        self.updates: dict[int, Any] = {}

    def on_client_message(self, loop, client_idx, message):  # type: ignore[no-untyped-def]
        self.down.append(set(message.tensors))

    def on_before_aggregate(self, loop, updates):  # type: ignore[no-untyped-def]
        for u in updates:
            self.up.append(set(u.message.tensors))
            self.updates[u.client_idx] = u


# ------------------------------------------------------------------------------------------------ the split
def test_presets_give_the_codes_splits_of_lenet_cifar() -> None:
    module = FederatedModule(LeNetCIFAR())
    assert personal_tensor_names(module, "head", 1) == ["backbone.fc3.weight", "backbone.fc3.bias"]  # FedRep
    lg = personal_tensor_names(module, "body", 2)  # LG-FedAvg: fc2, fc3 global
    assert lg == [f"backbone.{n}.{p}" for n in ("conv1", "conv2", "fc1") for p in ("weight", "bias")]
    assert personal_tensor_names(module, ["backbone.fc2", "backbone.fc3.bias"]) == [
        "backbone.fc2.weight", "backbone.fc2.bias", "backbone.fc3.bias"]
    fedrep, lgfedavg = PersonalLayers(), PersonalLayers(mode="lg")
    assert (fedrep.personal, fedrep.head_layers, fedrep.head_epochs) == ("head", 1, 10)
    assert (lgfedavg.personal, lgfedavg.head_layers, lgfedavg.head_epochs) == ("body", 2, 0)


def test_fedrep_head_is_never_aggregated_nor_counted(tmp_path: Path) -> None:
    traffic = Traffic()
    loop = tiny_loop(tmp_path, num_rounds=2, clients_per_round=2, local_epochs=2,
                     callbacks=[PersonalLayers(head_epochs=1), traffic])
    loop.fit(tiny_module(), tiny_datamodule())
    assert traffic.down and all(names == set(BODY) for names in traffic.down + traffic.up)
    for row in rows(tmp_path):  # 2 participants, the body's 1040 float32 values each way
        assert row["comm_bytes_up"] == row["comm_bytes_down"] == 2 * 4 * BODY_VALUES
    for n in HEAD:  # the server's copy of the head is the initial one
        assert torch.equal(loop.global_state[n], loop.initial_state[n])  # type: ignore[index]
    last = [u for u in traffic.updates.values() if u.round_idx == 1]
    expected = {n: sum(u.n_samples * u.state[n] for u in last) / sum(u.n_samples for u in last) for n in BODY}
    for n in BODY:
        assert torch.allclose(loop.global_state[n], expected[n], atol=1e-6)  # type: ignore[index]
    for k in range(4):  # a participant's personal model: the global body and its own trained head
        personal = loop.personal_state(k)
        trained = traffic.updates.get(k)
        for n in HEAD:
            ref = trained.state[n] if trained is not None else loop.initial_state[n]
            assert torch.equal(personal[n], ref)
        assert all(torch.equal(personal[n], loop.global_state[n]) for n in BODY)  # type: ignore[index]
    heads = [traffic.updates[k].state[HEAD[0]] for k in traffic.updates]
    assert len(heads) >= 2 and not torch.equal(heads[0], heads[1])


class Phases(FederatedCallback):
    """Which parameters each epoch changed, the learning rate of each epoch, and the flags after each fit."""

    scratch_attributes = ("changed", "lrs", "flags_after", "_before")  # test records, read in process only

    def __init__(self) -> None:
        self.changed: list[tuple[int, set[str]]] = []
        self.lrs: list[tuple[int, float]] = []
        self.flags_after: list[bool] = []
        self._before: dict[str, torch.Tensor] = {}

    def on_train_epoch_start(self, trainer, pl_module):  # type: ignore[no-untyped-def]
        self._before = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
        self.lrs.append((trainer.current_epoch, trainer.optimizers[0].param_groups[0]["lr"]))

    def on_train_epoch_end(self, trainer, pl_module):  # type: ignore[no-untyped-def]
        moved = {n for n, p in pl_module.named_parameters() if not torch.equal(p.detach(), self._before[n])}
        self.changed.append((trainer.current_epoch, moved))

    def on_client_fit_end(self, loop, module, update):  # type: ignore[no-untyped-def]
        self.flags_after.append(all(p.requires_grad for p in module.parameters()))


def test_fedrep_schedule_freezes_the_body_then_the_head(tmp_path: Path) -> None:
    # momentum and weight decay would move a part frozen only by zeroing its gradients
    phases = Phases()
    loop = tiny_loop(tmp_path, num_rounds=2, clients_per_round=2, local_epochs=3,
                     callbacks=[PersonalLayers(head_epochs=2, personal_lr=0.025), KeepOptimizerState(), phases])
    loop.fit(tiny_module(momentum=0.9, weight_decay=1e-3), tiny_datamodule())
    assert len(phases.changed) == 4 * 3
    for epoch, moved in phases.changed:
        assert moved == (set(HEAD) if epoch < 2 else set(BODY)), (epoch, moved)
    assert {(e, round(lr, 6)) for e, lr in phases.lrs} == {(0, 0.025), (1, 0.025), (2, 0.1)}
    assert phases.flags_after == [True] * 4  # requires_grad restored after every fit


def test_lg_keeps_the_representation_and_trains_all_layers_jointly(tmp_path: Path) -> None:
    traffic, phases = Traffic(), Phases()
    loop = tiny_loop(tmp_path, num_rounds=2, clients_per_round=2,
                     callbacks=[PersonalLayers(mode="lg", head_layers=1), traffic, phases])
    loop.fit(tiny_module(), tiny_datamodule())
    assert all(names == set(HEAD) for names in traffic.down + traffic.up)  # the global layer travels
    assert all(moved == set(HEAD + BODY) for _, moved in phases.changed)
    assert rows(tmp_path)[-1]["comm_bytes_up"] == 2 * 4 * HEAD_VALUES
    for n in BODY:
        assert torch.equal(loop.global_state[n], loop.initial_state[n])  # type: ignore[index]
    k = next(iter(traffic.updates))
    assert torch.equal(loop.personal_state(k)[BODY[0]], traffic.updates[k].state[BODY[0]])


def test_fedrep_training_flops_by_hand(tmp_path: Path) -> None:
    # per sample: forward 2·64·16 + 2·16·4 = 2176; head epoch: + the head's weight gradient 128 = 2304;
    # body epoch: + the head's input gradient 128 + the body's weight gradient 2048 = 4352 (dense: 4480)
    loop = tiny_loop(tmp_path, num_rounds=1, local_epochs=2, callbacks=[PersonalLayers(head_epochs=1)])
    dm = tiny_datamodule()
    loop.fit(tiny_module(), dm)
    assert loop.accounting.flops_per_sample() == 4480
    n = sum(dm.num_samples(k, "train") for k in range(4))
    assert rows(tmp_path)[-1]["flops_train"] == n * (2304 + 4352)


def test_fedavg_rounds_then_every_client_starts_from_the_global_layers(tmp_path: Path) -> None:
    class AtRoundOne(FederatedCallback):
        scratch_attributes = ("starts", "glob")  # test records, read in process only

        def on_round_start(self, loop, round_idx):  # type: ignore[no-untyped-def]
            if round_idx == 1:
                self.starts = [loop.client_store.get(k, "PersonalLayers/weights") for k in range(4)]
                self.glob = dict(loop.global_state)

    probe = AtRoundOne()
    loop = tiny_loop(tmp_path, num_rounds=2, callbacks=[PersonalLayers(mode="lg", head_layers=1, fedavg_rounds=1),
                                                        probe])
    loop.fit(tiny_module(), tiny_datamodule())
    first, second = rows(tmp_path)
    assert first["comm_bytes_up"] == 4 * 4 * (HEAD_VALUES + BODY_VALUES)  # round 0: FedAvg of everything
    assert second["comm_bytes_up"] == 4 * 4 * HEAD_VALUES
    for start in probe.starts:
        assert all(torch.equal(start[n], probe.glob[n]) for n in BODY)


# ------------------------------------------------------------------------------------------------ FedEM maths
def test_e_step_and_m_step_by_hand() -> None:
    p = torch.tensor([[0.8, 0.2], [0.1, 0.6]])  # p_m(y_i | x_i): 2 samples, 2 components
    pi = torch.tensor([0.25, 0.75])
    q = e_step(p.log(), pi)  # ∝ (0.2, 0.15) and (0.025, 0.45)
    assert torch.allclose(q, torch.tensor([[4 / 7, 3 / 7], [1 / 19, 18 / 19]]))
    assert torch.allclose(m_step_weights(q), torch.tensor([(4 / 7 + 1 / 19) / 2, (3 / 7 + 18 / 19) / 2]))
    assert torch.equal(e_step(p.log(), torch.tensor([0.0, 1.0]))[:, 0], torch.zeros(2))  # π_m = 0: q = 0
    logits = torch.tensor([[[1.0, 0.0, -1.0], [0.0, 2.0, 0.0]]])  # [B=1, M=2, C=3]
    mix = 0.25 * logits[0, 0].softmax(0) + 0.75 * logits[0, 1].softmax(0)
    assert torch.allclose(mixture_log_prob(logits, pi).exp()[0], mix)
    y = torch.tensor([2])
    ll = component_log_likelihood(logits, y)
    assert torch.allclose(ll, torch.stack([logits[0, 0].log_softmax(0)[2], logits[0, 1].log_softmax(0)[2]])[None])
    w = torch.tensor([[0.3, 0.7]])
    assert torch.allclose(weighted_nll(logits, y, w), -(w * ll).sum())


def _plain_fedem_round(initial: dict[str, torch.Tensor], dm: Any, seeds: list[int], lr: float
                       ) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """One FedEM round written out by hand (the FedEM code's MixtureClient.step + FedAvg of every learner)."""
    torch.manual_seed(0)
    template = MLP(num_classes=4, in_channels=1, input_size=8, hidden=[16])
    states, weights, pis = [], [], []
    for k, seed in enumerate(seeds):
        comps = [copy.deepcopy(template) for _ in range(3)]
        for m, c in enumerate(comps):
            c.load_state_dict({n[len(f"backbone.components.{m}."):]: t for n, t in initial.items()
                               if n.startswith(f"backbone.components.{m}.")})
        received = copy.deepcopy(comps)
        opt = torch.optim.SGD([p for c in comps for p in c.parameters()], lr=lr)
        q_sum, seen = torch.zeros(3), 0
        for x, y in dm.train_loader(k, seed=seed):
            with torch.no_grad():  # E-step under the received learners: q ∝ π_m · p_m(y | x), π uniform
                lik = torch.stack([F.softmax(c(x), 1).gather(1, y[:, None])[:, 0] for c in received], 1)
                q = lik / lik.sum(1, keepdim=True)
            loss = sum((q[:, m] * F.cross_entropy(c(x), y, reduction="none")).sum() / len(y)
                       for m, c in enumerate(comps))
            opt.zero_grad()
            loss.backward()  # type: ignore[union-attr]
            opt.step()
            q_sum += q.sum(0)
            seen += len(y)
        pis.append(q_sum / seen)
        states.append({f"backbone.components.{m}.{n}": t.detach() for m, c in enumerate(comps)
                       for n, t in c.state_dict().items()})
        weights.append(dm.num_samples(k, "train"))
    glob = {n: sum(w * s[n] for w, s in zip(weights, states)) / sum(weights) for n in states[0]}
    return glob, pis


def test_fedem_round_matches_a_plain_reimplementation(tmp_path: Path) -> None:
    traffic = Traffic()
    loop = tiny_loop(tmp_path, num_rounds=1, callbacks=[FedEM(), traffic])
    dm = tiny_datamodule()
    module = mix_module()
    initial = {n: t.clone() for n, t in module.state_dict().items()}
    loop.fit(module, dm)
    seeds = [loop.streams.fit_seed("train", 0, k) for k in range(4)]
    glob, pis = _plain_fedem_round(initial, dm, seeds, lr=0.1)
    for n, t in glob.items():
        assert torch.allclose(loop.global_state[n], t, atol=1e-6), n  # type: ignore[index]
    for k in range(4):
        assert torch.allclose(loop.personal_state(k)[WEIGHTS], pis[k], atol=1e-6)
    assert not torch.allclose(pis[0], torch.full((3,), 1 / 3))


def test_fedem_mixture_weights_stay_private_and_drive_the_personal_prediction(tmp_path: Path) -> None:
    traffic = Traffic()
    loop = tiny_loop(tmp_path, num_rounds=2, clients_per_round=2, callbacks=[FedEM(), traffic])
    dm = tiny_datamodule()
    loop.fit(mix_module(), dm)
    assert traffic.down and all(WEIGHTS not in names and len(names) == 3 * 4 for names in traffic.down + traffic.up)
    for row in rows(tmp_path):  # 3 components of 1108 float32 values, each way, per participant
        assert row["comm_bytes_up"] == row["comm_bytes_down"] == 2 * 3 * 4 * (HEAD_VALUES + BODY_VALUES)
        assert 1 / 3 <= row["fedem_pi_max"] < 1
    assert torch.equal(loop.global_state[WEIGHTS], torch.full((3,), 1 / 3))  # type: ignore[index]
    net = mix_module()
    for k in range(4):
        pi = loop.personal_state(k)[WEIGHTS]
        assert torch.allclose(pi.sum(), torch.tensor(1.0))
        net.load_state_dict(loop.personal_state(k))
        with torch.no_grad():
            x, y = zip(*dm.eval_loader(k, split="test"))
            probs = sum(pi[m] * F.softmax(c(torch.cat(x)), 1) for m, c in enumerate(net.backbone.components))
        acc = float((probs.argmax(1) == torch.cat(y)).float().mean())  # type: ignore[union-attr]
        assert acc == pytest.approx(loop.last_client_acc[k])


# ------------------------------------------------------------------------------------------------ resume
def _strip_times(rs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if not k.startswith("time")} for r in rs]


@pytest.mark.parametrize("method", ["fedem", "fedrep"])
@pytest.mark.slow
def test_resume_after_round_two_of_four_is_identical(tmp_path: Path, method: str) -> None:
    def setup() -> tuple[list[Any], Any]:
        if method == "fedem":
            return [FedEM(lr_milestones=[0.5]), KeepOptimizerState()], lambda seed: mix_module(seed, momentum=0.9)
        return [PersonalLayers(head_epochs=1)], lambda seed: tiny_module(seed, momentum=0.9)

    callbacks, make = setup()
    full = tiny_loop(tmp_path / "full", num_rounds=4, clients_per_round=2, local_epochs=2, callbacks=callbacks)
    full.fit(make(0), tiny_datamodule())
    callbacks, make = setup()
    stopped = tiny_loop(tmp_path / "cut", num_rounds=4, clients_per_round=2, local_epochs=2, callbacks=callbacks)
    fit_until_interrupted(stopped, 2, make(0), tiny_datamodule())
    ckpt = tmp_path / "cut" / "checkpoints" / "last.ckpt"
    callbacks, make = setup()
    resumed = tiny_loop(tmp_path / "cut", num_rounds=4, clients_per_round=2, local_epochs=2, callbacks=callbacks)
    resumed.fit(make(123), tiny_datamodule(), ckpt_path=str(ckpt))  # the initialisation is overwritten
    assert _strip_times(rows(tmp_path / "cut")) == _strip_times(rows(tmp_path / "full"))
    for k in range(4):
        a, b = full.personal_state(k), resumed.personal_state(k)
        assert all(torch.equal(a[n], b[n]) for n in a)


# ------------------------------------------------------------------------------------------------ CLI
@pytest.mark.parametrize("name", ["synthetic_fedrep", "synthetic_lgfedavg", "synthetic_fedem"])
@pytest.mark.slow
def test_synthetic_configs_run(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rs = fit_rows(["--config", str(REPO_CONFIGS / f"{name}.yaml"), "--trainer.num_rounds", "2",
                   "--trainer.eval_every", "2", "--data.num_clients", "4", "--trainer.enable_progress_bar", "false",
                   "--trainer.default_root_dir", str(tmp_path / "run")], capsys)
    assert [r["round"] for r in rs] == [1] and 0.0 <= rs[-1]["acc_mean"] <= 1.0  # (evaluated rounds only)
    assert rs[-1]["comm_bytes_up"] > 0
    if name == "synthetic_fedem":
        assert rs[-1]["global_acc"] is not None and rs[-1]["fedem_pi_max"] >= 1 / 3


def _yaml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return str(path)


MIXTURE = ("model:\n  backbone:\n    class_path: pl_fedsparse.models.Mixture\n    init_args:\n      backbone:\n"
           "        class_path: pl_fedsparse.models.MLP\n"
           "        init_args: {num_classes: 4, in_channels: 1, input_size: 8}\n      num_components: 2\n")


@pytest.mark.parametrize("config, expected", [
    (("trainer:\n  callbacks: [{class_path: pl_fedsparse.callbacks.PersonalLayers, init_args: {mode: lg, "
      "head_epochs: 3}}]\n"), "PersonalLayers.head_epochs=3 is invalid: expected null with mode: lg"),
    ("trainer:\n  callbacks: [{class_path: pl_fedsparse.callbacks.PersonalLayers}]\n",
     "PersonalLayers.head_epochs=10 is invalid: expected fewer than trainer.local_epochs=1"),
    (("trainer:\n  callbacks: [{class_path: pl_fedsparse.callbacks.PersonalLayers, init_args: {mode: lg, "
      "personal: [backbone.conv9]}}]\n"), "PersonalLayers.personal='backbone.conv9' is invalid: expected a prefix"),
    ("trainer:\n  callbacks: [{class_path: pl_fedsparse.callbacks.FedEM}]\n",
     "model.backbone=MLP is invalid for FedEM: expected a module whose `backbone` is a pl_fedsparse.models.Mixture"),
    ("trainer:\n  callbacks: [{class_path: pl_fedsparse.callbacks.FedEM}]\n" + MIXTURE,
     "FedEM.num_components=3 is invalid: expected 2, the number of components"),
])
def test_bad_options_are_one_line_errors(config: str, expected: str, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(["fit", *TINY_CLI, "--config", _yaml(tmp_path, config), "--trainer.num_rounds", "1",
                             "--trainer.default_root_dir", str(tmp_path / "run")], capsys)
    assert code == 2
    assert expected in one_line(err)


@pytest.mark.parametrize("kwargs, param", [
    ({"mode": "fedavg"}, "PersonalLayers.mode"), ({"personal": "top"}, "PersonalLayers.personal"),
    ({"personal": ["backbone.fc3"], "head_layers": 2}, "PersonalLayers.head_layers"),
    ({"mode": "lg", "personal_lr": 0.1}, "PersonalLayers.personal_lr"), ({"fedavg_rounds": -1},
                                                                        "PersonalLayers.fedavg_rounds"),
])
def test_bad_personal_layers_arguments(kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(ConfigError, match=param.replace(".", r"\.")):
        PersonalLayers(**kwargs)


@pytest.mark.parametrize("kwargs, param", [({"num_components": 0}, "FedEM.num_components"),
                                           ({"lr_milestones": [1.5]}, "FedEM.lr_milestones"),
                                           ({"lr_gamma": 0}, "FedEM.lr_gamma")])
def test_bad_fedem_arguments(kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(ConfigError, match=param.replace(".", r"\.")):
        FedEM(**kwargs)
