"""FederatedLoop: hook order, aggregation, order independence, evaluation, files, resume."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import fit_until_interrupted, tiny_datamodule, tiny_loop, tiny_module

from pl_fedsparse import ConfigError, FederatedCallback
from pl_fedsparse.callbacks import FineTune, LocalTraining
from pl_fedsparse.errors import CheckpointError
from pl_fedsparse.functional import weighted_average


class Recorder(FederatedCallback):
    """Records federation hooks and a few Lightning hooks, in order."""

    scratch_attributes = ("events",)  # test records, read in process only

    def __init__(self) -> None:
        self.events: list[str] = []

    def on_federation_start(self, loop):  # type: ignore[no-untyped-def]
        self.events.append("federation_start")

    def on_round_start(self, loop, round_idx):  # type: ignore[no-untyped-def]
        self.events.append(f"round_start:{round_idx}")

    def on_client_fit_start(self, loop, module, context):  # type: ignore[no-untyped-def]
        self.events.append(f"client_fit_start:{context.client_idx}")

    def on_fit_start(self, trainer, pl_module):  # type: ignore[no-untyped-def]  (Lightning)
        self.events.append("fit_start")

    def on_train_epoch_start(self, trainer, pl_module):  # type: ignore[no-untyped-def]
        self.events.append("train_epoch_start")

    def on_train_epoch_end(self, trainer, pl_module):  # type: ignore[no-untyped-def]
        self.events.append("train_epoch_end")

    def on_fit_end(self, trainer, pl_module):  # type: ignore[no-untyped-def]
        self.events.append("fit_end")

    def on_client_fit_end(self, loop, module, update):  # type: ignore[no-untyped-def]
        self.events.append(f"client_fit_end:{update.client_idx}")

    def on_before_aggregate(self, loop, updates):  # type: ignore[no-untyped-def]
        self.events.append(f"before_aggregate:{[u.client_idx for u in updates]}")

    def on_after_aggregate(self, loop):  # type: ignore[no-untyped-def]
        self.events.append("after_aggregate")

    def on_client_evaluate_start(self, loop, module, client_idx, kind):  # type: ignore[no-untyped-def]
        self.events.append(f"evaluate_start:{client_idx}:{kind}")

    def on_client_evaluate_end(self, loop, module, client_idx, kind, metrics):  # type: ignore[no-untyped-def]
        self.events.append(f"evaluate_end:{client_idx}:{kind}")

    def on_round_end(self, loop, round_idx, metrics):  # type: ignore[no-untyped-def]
        self.events.append(f"round_end:{round_idx}")

    def on_federation_end(self, loop):  # type: ignore[no-untyped-def]
        self.events.append("federation_end")


def test_hook_order_two_clients_two_rounds(tmp_path: Path) -> None:
    rec = Recorder()
    loop = tiny_loop(tmp_path, num_rounds=2, local_epochs=2, callbacks=[rec])
    loop.fit(tiny_module(), tiny_datamodule(num_clients=2))
    client = ["fit_start", "train_epoch_start", "train_epoch_end", "train_epoch_start", "train_epoch_end", "fit_end"]
    expected = ["federation_start"]
    for r in range(2):
        expected.append(f"round_start:{r}")
        for k in range(2):
            expected += [f"client_fit_start:{k}", *client, f"client_fit_end:{k}"]
        expected += ["before_aggregate:[0, 1]", "after_aggregate"]
        # both model kinds get their evaluate hooks (FedAvg's global logits are reused: the weights are identical)
        for k in range(2):
            expected += [f"evaluate_start:{k}:personal", f"evaluate_end:{k}:personal",
                         f"evaluate_start:{k}:global", f"evaluate_end:{k}:global"]
        expected.append(f"round_end:{r}")
    expected.append("federation_end")
    assert rec.events == expected


def test_fedavg_aggregate_is_sample_weighted_mean(tmp_path: Path) -> None:
    captured: dict[str, Any] = {}

    class Grab(FederatedCallback):
        def on_before_aggregate(self, loop, updates):  # type: ignore[no-untyped-def]
            captured["updates"] = list(updates)

    loop = tiny_loop(tmp_path, num_rounds=1, callbacks=[Grab()])
    loop.fit(tiny_module(), tiny_datamodule())
    ups = captured["updates"]
    assert len({u.n_samples for u in ups}) >= 1
    total = sum(u.n_samples for u in ups)
    for key, value in loop.global_state.items():  # type: ignore[union-attr]
        manual = sum(u.state[key].double() * (u.n_samples / total) for u in ups)
        torch.testing.assert_close(value.double(), manual, rtol=1e-5, atol=1e-6)


def test_single_client_fedavg_equals_its_local_fit(tmp_path: Path) -> None:
    loop = tiny_loop(tmp_path, num_rounds=1)
    dm = tiny_datamodule(num_clients=1)
    loop.fit(tiny_module(), dm)
    again = tiny_loop(tmp_path / "b", num_rounds=1)
    again.fit(tiny_module(), tiny_datamodule(num_clients=1))
    again.round_idx = 0
    up = again.run_fits([again.fit_request(0, again.initial_state)])[0]
    for k, v in up.state.items():
        torch.testing.assert_close(v, loop.global_state[k])  # type: ignore[index]


def test_client_order_does_not_change_results(tmp_path: Path) -> None:
    loop = tiny_loop(tmp_path, num_rounds=1)
    loop.fit(tiny_module(), tiny_datamodule())
    start = dict(loop.global_state)  # type: ignore[arg-type]
    loop.round_idx = 3
    a = {u.client_idx: u.state for u in loop.run_fits([loop.fit_request(k, start) for k in (0, 1, 2)])}
    b = {u.client_idx: u.state for u in loop.run_fits([loop.fit_request(k, start) for k in (2, 0, 1)])}
    for k in a:
        for name in a[k]:
            assert torch.equal(a[k][name], b[k][name])
    # different clients (different data and random streams) do get different results
    assert any(not torch.equal(a[0][name], a[1][name]) for name in a[0])


def test_sampling_is_seeded_by_seed_and_round(tmp_path: Path) -> None:
    loop = tiny_loop(tmp_path, num_rounds=1, clients_per_round=2, seed=5)
    loop.fit(tiny_module(), tiny_datamodule(num_clients=4))
    picks = [loop.select_clients(r) for r in range(6)]
    assert all(len(p) == 2 and len(set(p)) == 2 for p in picks)
    assert picks == [loop.select_clients(r) for r in range(6)]
    assert len({tuple(p) for p in picks}) > 1
    other = tiny_loop(tmp_path / "o", num_rounds=1, clients_per_round=2, seed=6)
    other.fit(tiny_module(), tiny_datamodule(num_clients=4))
    assert [other.select_clients(r) for r in range(6)] != picks


def test_local_training_communicates_nothing_and_keeps_personal_models(tmp_path: Path) -> None:
    loop = tiny_loop(tmp_path, num_rounds=2, callbacks=[LocalTraining()])
    summary = loop.fit(tiny_module(), tiny_datamodule())
    assert summary["comm_cum_bytes_total"] == 0
    assert loop.global_state is None
    w0 = loop.personal_state(0)
    w1 = loop.personal_state(1)
    assert any(not torch.equal(w0[k], w1[k]) for k in w0)
    assert summary["final"]["global_acc"] is None


def test_finetune_counts_download_and_changes_personal_models(tmp_path: Path) -> None:
    ft = FineTune(epochs=1)
    loop = tiny_loop(tmp_path, num_rounds=2, callbacks=[ft])
    summary = loop.fit(tiny_module(), tiny_datamodule())
    nbytes = sum(v.numel() * 4 for v in loop.global_state.values())  # type: ignore[union-attr]
    # 2 rounds x 4 clients x (down + up) + fine-tuning download to 4 clients
    assert summary["comm_cum_bytes_total"] == (2 * 4 * 2 + 4) * nbytes
    p = ft.get_client_state(loop, 0, "weights")
    assert any(not torch.equal(p[k], loop.global_state[k]) for k in p)  # type: ignore[index]
    assert summary["final"]["global_acc"] is not None
    assert summary["final"]["acc_mean"] != summary["final"]["global_acc"]  # personal = the fine-tuned models


def test_run_directory_files(tmp_path: Path) -> None:
    loop = tiny_loop(tmp_path, num_rounds=3, eval_every=2, logger=True)
    loop.fit(tiny_module(), tiny_datamodule())
    every = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # a row per round: costs always, accuracies on the evaluated rounds (every 2nd and the last)
    assert [(r["round"], r["evaluated"]) for r in every] == [(0, False), (1, True), (2, True)]
    costs = {"round", "comm_bytes_up", "comm_bytes_down", "comm_bytes_total", "flops_train", "time_s", "train_loss",
             "num_participants", "client_faults"}
    assert costs <= set(every[0]) and not {"acc_mean", "global_acc", "loss_mean"} & set(every[0])
    rows = every[1:]
    keys = {"round", "acc_mean", "acc_weighted", "acc_std", "acc_bottom10", "global_acc", *costs}
    assert keys <= set(rows[0])
    assert rows[-1]["comm_cum_bytes_total"] == 3 * rows[0]["comm_bytes_total"]
    assert rows[0]["flops_train"] > 0
    assert (tmp_path / "summary.json").is_file()
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_existing_run_directory_is_refused(tmp_path: Path) -> None:
    tiny_loop(tmp_path, num_rounds=1).fit(tiny_module(), tiny_datamodule())
    with pytest.raises(ConfigError, match="default_root_dir"):
        tiny_loop(tmp_path, num_rounds=1).fit(tiny_module(), tiny_datamodule())


def _strip_times(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if not k.startswith("time")} for r in rows]


@pytest.mark.parametrize("callbacks", [[], [LocalTraining()]], ids=["fedavg", "local"])
def test_resume_after_round_two_of_four_is_identical(tmp_path: Path, callbacks: list[Any]) -> None:
    full = tiny_loop(tmp_path / "full", num_rounds=4, clients_per_round=2, callbacks=callbacks)
    full.fit(tiny_module(), tiny_datamodule())

    stopped = tiny_loop(tmp_path / "cut", num_rounds=4, clients_per_round=2, callbacks=callbacks)
    fit_until_interrupted(stopped, 2, tiny_module(), tiny_datamodule())
    ckpt = tmp_path / "cut" / "checkpoints" / "last.ckpt"
    assert torch.load(ckpt, weights_only=True)["round"] == 2

    resumed = tiny_loop(tmp_path / "cut", num_rounds=4, clients_per_round=2, callbacks=callbacks)
    resumed.fit(tiny_module(seed=123), tiny_datamodule(), ckpt_path=str(ckpt))  # init is overwritten by the ckpt

    def rows(d: str) -> list[dict[str, Any]]:
        return [json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]

    assert _strip_times(rows("cut")) == _strip_times(rows("full"))
    assert len(rows("cut")) == 4
    if full.global_state is not None:
        for k, v in full.global_state.items():
            assert torch.equal(v, resumed.global_state[k])  # type: ignore[index]
    for k in range(4):
        a, b = full.personal_state(k), resumed.personal_state(k)
        for name in a:
            assert torch.equal(a[name], b[name])


def test_checkpoint_from_another_config_is_refused(tmp_path: Path) -> None:
    tiny_loop(tmp_path / "a", num_rounds=1).fit(tiny_module(), tiny_datamodule(alpha=0.5))
    ckpt = str(tmp_path / "a" / "checkpoints" / "last.ckpt")
    with pytest.raises(CheckpointError, match=r"another configuration \(data\.alpha: 0\.5 in the checkpoint vs 2\.0"):
        tiny_loop(tmp_path / "b", num_rounds=2).fit(tiny_module(), tiny_datamodule(alpha=2.0), ckpt_path=ckpt)
    assert not (tmp_path / "b").exists()  # nothing written


def test_corrupted_checkpoint_is_one_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError, match="ckpt_path=.*bad.ckpt.*corrupted"):
        tiny_loop(tmp_path / "r", num_rounds=1).fit(tiny_module(), tiny_datamodule(), ckpt_path=str(bad))


def test_checkpoint_does_not_unpickle_objects(tmp_path: Path) -> None:
    class Evil:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (print, ("pwned",))

    path = tmp_path / "evil.ckpt"
    torch.save({"format": "pl_fedsparse.checkpoint/1", "x": Evil()}, path)
    with pytest.raises(CheckpointError):
        tiny_loop(tmp_path / "r", num_rounds=1).fit(tiny_module(), tiny_datamodule(), ckpt_path=str(path))


def test_two_owners_of_a_policy_is_an_error(tmp_path: Path) -> None:
    class A(FederatedCallback):
        def aggregate(self, loop, updates):  # type: ignore[no-untyped-def]
            return loop.global_state

    class B(A):
        pass

    with pytest.raises(ConfigError, match="'aggregate' is claimed by both A and B"):
        tiny_loop(tmp_path, num_rounds=1, callbacks=[A(), B()]).fit(tiny_module(), tiny_datamodule())


def test_wrong_num_classes_is_one_clear_error(tmp_path: Path) -> None:
    from pl_fedsparse import FederatedModule
    from pl_fedsparse.models import MLP

    module = FederatedModule(MLP(num_classes=7, in_channels=1, input_size=8))
    with pytest.raises(ConfigError, match="num_classes=7 is invalid: expected 4"):
        tiny_loop(tmp_path, num_rounds=1).fit(module, tiny_datamodule())


def test_weighted_average_matches_manual() -> None:
    states = [{"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([3.0, 6.0])}]
    out = weighted_average(states, [3, 1])
    torch.testing.assert_close(out["w"], torch.tensor([1.5, 3.0]))


def test_keep_optimizer_state_persists_momentum_and_resumes(tmp_path: Path) -> None:
    from pl_fedsparse.callbacks import KeepOptimizerState

    keep = KeepOptimizerState()
    loop = tiny_loop(tmp_path / "k", num_rounds=2, callbacks=[LocalTraining(), keep])
    loop.fit(tiny_module(momentum=0.9), tiny_datamodule())
    buf = keep.get_client_state(loop, 0, "state")
    assert buf and all(v.abs().sum() > 0 for v in buf.values())
    fresh = tiny_loop(tmp_path / "f", num_rounds=2, callbacks=[LocalTraining()])
    fresh.fit(tiny_module(momentum=0.9), tiny_datamodule())
    a, b = loop.personal_state(0), fresh.personal_state(0)
    assert any(not torch.equal(a[k], b[k]) for k in a)  # round 2 started from the kept momentum

    # the optimizer state is checkpointed with the federation: a resumed run matches an uninterrupted one
    full = tiny_loop(tmp_path / "full", num_rounds=3, callbacks=[LocalTraining(), KeepOptimizerState()])
    full.fit(tiny_module(momentum=0.9), tiny_datamodule())
    cut = tiny_loop(tmp_path / "cut", num_rounds=2, callbacks=[LocalTraining(), KeepOptimizerState()])
    cut.fit(tiny_module(momentum=0.9), tiny_datamodule())
    res = tiny_loop(tmp_path / "cut", num_rounds=3, callbacks=[LocalTraining(), KeepOptimizerState()])
    res.fit(tiny_module(momentum=0.9), tiny_datamodule(), ckpt_path=str(tmp_path / "cut/checkpoints/last.ckpt"))
    for k in range(4):
        x, y = full.personal_state(k), res.personal_state(k)
        assert all(torch.equal(x[n], y[n]) for n in x)


_SUBNORMAL = 1e-39  # below float32's smallest normal (1.18e-38)


class _SubnormalProbe(FederatedCallback):
    """Records what a subnormal float32 times one is inside the fit (0.0 where subnormals are flushed)."""

    scratch_attributes = ("seen",)  # a probe for the test, not state a resume needs

    def __init__(self) -> None:
        self.seen: float | None = None

    def on_federation_start(self, loop: Any) -> None:
        self.seen = float(torch.tensor([_SUBNORMAL], dtype=torch.float32).mul(1.0))


@pytest.mark.parametrize("flush", [False, True])
def test_flush_denormal_holds_during_the_fit_only(tmp_path: Path, flush: bool) -> None:
    """trainer.flush_denormal: subnormals are zero inside the fit (the CPU skips its slow path for them) and the
    process is back to torch's default after it."""
    probe = _SubnormalProbe()
    loop = tiny_loop(tmp_path, num_rounds=1, flush_denormal=flush, callbacks=[probe])
    loop.fit(tiny_module(), tiny_datamodule())
    assert probe.seen == (0.0 if flush else pytest.approx(_SUBNORMAL, rel=1e-2))
    assert float(torch.tensor([_SUBNORMAL], dtype=torch.float32).mul(1.0)) != 0.0  # restored after the fit


def test_flush_denormal_must_be_a_bool(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="trainer.flush_denormal"):
        tiny_loop(tmp_path, flush_denormal="yes")
