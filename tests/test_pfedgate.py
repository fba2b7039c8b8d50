"""pFedGate in federations (:class:`pl_fedsparse.callbacks.PFedGate`): two rounds against a plain re-implementation of
Alg. 1 (joint θ/φ steps, per-module clipping, per-client gate momentum across rounds), gates private (never in the
global state, never in a message, bytes counted by hand), resume bit-exact, the three aggregation rules on a
hand-checkable case, s = 1 as dense training of θ ⊙ M, bf16-mixed, the CLI config and one-line errors.

The maths of the functional core (block split, knapsack, straight-through) is tested in
``tests/test_pfedgate_functional.py``; expectations here are derived by hand or by an independent loop.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import fit_rows, fit_until_interrupted, one_line, run_main, tiny_datamodule, tiny_loop, tiny_module

from pl_fedsparse import ConfigError, FederatedCallback
from pl_fedsparse.callbacks import KeepOptimizerState, NovelClients, PFedGate
from pl_fedsparse.callbacks.pfedgate import BLOCKS, UNION, fold_density
from pl_fedsparse.client import ClientUpdate, Message
from pl_fedsparse.functional.gate import adapt_gated_weights, block_table, make_block_table, personalized_params
from pl_fedsparse.functional.gate_upload import pack_blocks
from pl_fedsparse.models.gate import GatingLayer
from pl_fedsparse.streams import Streams

REPO = Path(__file__).resolve().parents[1]
# the tiny MLP (1×8×8 → 16 → 4) split with B = 5: 1024 → 205×4 + 204; 16 → 4×4 (⌈16/5⌉ = 4); 64 → 13×4 + 12; 4 → 1×4
TINY_SIZES = [205] * 4 + [204] + [4] * 4 + [13] * 4 + [12] + [1] * 4
TINY_D = 1024 + 16 + 64 + 4
TIME_KEYS = ("time_s", "time_train_s", "time_cum_s")


class Spy(FederatedCallback):  # records every round's updates as they reach the server
    def __init__(self) -> None:
        self.rounds: list[list[ClientUpdate]] = []

    def on_before_aggregate(self, loop: Any, updates: Any) -> None:
        self.rounds.append(list(updates))


def _rows(run: Path) -> list[dict[str, Any]]:
    return [{k: v for k, v in json.loads(x).items() if k not in TIME_KEYS}
            for x in (run / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------------------------- Alg. 1, re-implemented

def test_two_rounds_equal_a_plain_implementation_of_algorithm_1(tmp_path: Path) -> None:
    rounds, clients, s, eta = 2, 3, 0.5, 0.3
    clip_gate, clip_model = 0.05, 0.5  # small, so that both clips act (the code's are 10 and 10)
    loop = tiny_loop(tmp_path, num_rounds=rounds, gradient_clip_val=clip_model,
                     callbacks=[PFedGate(density=s, gate_lr=eta, separate_paths=False, gate_clip=clip_gate)])
    # 100 samples per client in batches of 11: every epoch ends with a batch of one sample, which the code skips
    loop.fit(tiny_module(), tiny_datamodule(num_clients=clients, batch_size=11))

    dm = tiny_datamodule(num_clients=clients, batch_size=11)
    dm.setup("fit")
    streams = Streams(loop.seed)
    model = tiny_module()
    table = block_table(model, 5)
    assert list(table.sizes) == TINY_SIZES
    torch.manual_seed(streams.seed("pfedgate.init", 0))  # the code seeds before building every client's gate
    gate0 = GatingLayer(len(TINY_SIZES), in_channels=1, input_size=8, separate_paths=False)
    gates = {i: copy.deepcopy(gate0) for i in range(clients)}
    # SGD(0.9, 5e-4) per gate, kept across rounds (the code keeps each client's optimizer object)
    gate_opts = {i: torch.optim.SGD(gates[i].parameters(), lr=eta, momentum=0.9, weight_decay=5e-4)
                 for i in range(clients)}
    glob = {k: v.clone() for k, v in model.state_dict().items()}
    for r in range(rounds):
        trained, ns = [], []
        for i in range(clients):
            model.load_state_dict(glob)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)  # the module's: fresh each fit, no momentum
            seed = streams.fit_seed("train", r, i)
            torch.manual_seed(seed)
            for x, y in dm.train_loader(i, seed=seed):
                if len(y) < 2:  # gated_learner.py:377 skips batches of one sample
                    continue
                g, m = gates[i](x, s_min=0.2)  # s_min = min(max(1/5, 0.1), 0.5)
                m_sparse, _ = adapt_gated_weights(g, m, table, s)
                theta = personalized_params(dict(model.named_parameters()), m_sparse, table)
                loss = F.cross_entropy(torch.func.functional_call(model, theta, (x,)), y)
                opt.zero_grad()
                gate_opts[i].zero_grad()
                loss.backward()  # one backward for θ and φ
                torch.nn.utils.clip_grad_norm_(gates[i].parameters(), clip_gate)  # each module clipped on its own
                gate_opts[i].step()
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip_model)
                opt.step()
            trained.append({k: v.detach().clone() for k, v in model.state_dict().items()})
            ns.append(dm.num_samples(i, "train"))
        glob = {k: sum(n * t[k] for n, t in zip(ns, trained)) / sum(ns) for k in glob}  # the code's dense FedAvg
    for k in glob:
        torch.testing.assert_close(loop.global_state[k], glob[k], rtol=1e-5, atol=1e-6)
    for i in range(clients):
        mine = loop.client_store.get(i, "PFedGate/gate")
        for k, v in gates[i].state_dict().items():
            torch.testing.assert_close(mine[k], v, rtol=1e-5, atol=1e-6)
        momentum = loop.client_store.get(i, "PFedGate/gate_optimizer")
        expected = [gate_opts[i].state[p]["momentum_buffer"] for p in gates[i].parameters()]
        torch.testing.assert_close([momentum[f"{j}.momentum_buffer"] for j in range(len(expected))], expected,
                                   rtol=1e-5, atol=1e-6)
    # every gate trained on its own data: they differ from each other
    assert not torch.equal(loop.client_store.get(0, "PFedGate/gate")["gating.1.weight"],
                           loop.client_store.get(1, "PFedGate/gate")["gating.1.weight"])


# -------------------------------------------------------------------------------------- gates are private

def _union_bytes(union: torch.Tensor) -> int:
    return 4 * sum(w for w, u in zip(TINY_SIZES, union.tolist()) if u) + math.ceil(len(TINY_SIZES) / 8)


def _ewa_bytes(message: Message) -> int:
    total = 0
    for t in message.tensors.values():
        nnz = int((t != 0).sum())
        total += 4 * nnz + min(math.ceil(t.numel() / 8), 4 * nnz)
    return total


@pytest.mark.parametrize("aggregation", ["fedavg", "index", "ewa"])
@pytest.mark.slow
def test_gates_are_never_aggregated_nor_counted_as_traffic(tmp_path: Path, aggregation: str) -> None:
    spy = Spy()
    loop = tiny_loop(tmp_path, num_rounds=2, clients_per_round=3,
                     callbacks=[PFedGate(density=0.5, aggregation=aggregation), KeepOptimizerState(), spy])
    loop.fit(tiny_module(momentum=0.9), tiny_datamodule())
    model_keys = set(tiny_module().state_dict())
    assert set(loop.global_state) == model_keys  # no gate tensor in the global model
    gate_keys = set(loop.client_store.get(0, "PFedGate/gate"))
    assert gate_keys and not gate_keys & model_keys
    for r, updates in enumerate(spy.rounds):
        up = 0
        for u in updates:
            names = set(u.message.tensors)
            assert names <= model_keys and not names & gate_keys  # only global-model tensors travel
            union = u.extras[UNION]
            if aggregation == "fedavg":  # the dense trained model
                assert names == model_keys
                expected = 4 * TINY_D
            elif aggregation == "index":  # the union's values and an L-bit block index
                assert set(u.message.masks) == {BLOCKS} and torch.equal(u.message.masks[BLOCKS], union)
                expected = _union_bytes(union)
            else:
                expected = _ewa_bytes(u.message)
            assert u.message.nbytes() == expected
            up += expected
            q = sum(w for w, b in zip(TINY_SIZES, union.tolist()) if b) / TINY_D
            assert u.metrics["gate_upload_ratio"] == pytest.approx(q)
        row = loop.history[r]
        assert row["comm_bytes_up"] == up
        assert row["comm_bytes_down"] == 3 * 4 * TINY_D  # the dense global model to each participant; no gate
        assert 0.2 < row["gate_density"] <= 0.5 + 1e-9 and row["gate_upload_ratio"] >= row["gate_density_train"]
    # the gates trained (they left the shared initial weights) but stayed client state
    cb = loop.callbacks[0]
    assert isinstance(cb, PFedGate)
    assert not torch.equal(loop.client_store.get(0, "PFedGate/gate")["gating.1.weight"], cb._template["gating.1.weight"])


@pytest.mark.slow
def test_resume_mid_run_restores_gates_and_their_momentum_bit_exactly(tmp_path: Path) -> None:
    def callbacks() -> list[Any]:
        return [PFedGate(density=0.5, aggregation="index", same_init=False, straight_through="code"),
                KeepOptimizerState()]

    full = tiny_loop(tmp_path / "full", num_rounds=4, clients_per_round=2, callbacks=callbacks())
    full.fit(tiny_module(momentum=0.9), tiny_datamodule())
    stopped = tiny_loop(tmp_path / "cut", num_rounds=4, clients_per_round=2, callbacks=callbacks())
    fit_until_interrupted(stopped, 2, tiny_module(momentum=0.9), tiny_datamodule())
    ckpt = tmp_path / "cut" / "checkpoints" / "last.ckpt"
    assert torch.load(ckpt, weights_only=True)["round"] == 2
    resumed = tiny_loop(tmp_path / "cut", num_rounds=4, clients_per_round=2, callbacks=callbacks())
    resumed.fit(tiny_module(seed=123, momentum=0.9), tiny_datamodule(), ckpt_path=str(ckpt))

    assert _rows(tmp_path / "cut") == _rows(tmp_path / "full")
    for k, v in full.global_state.items():
        assert torch.equal(v, resumed.global_state[k])
    for i in range(4):
        for name in ("PFedGate/gate", "PFedGate/gate_optimizer"):
            a, b = full.client_store.get(i, name), resumed.client_store.get(i, name)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (i, name)
    assert full.client_store.get(0, "PFedGate/gate_optimizer")  # the momentum exists and was compared


# -------------------------------------------------------------------------------------------- aggregation

#  one linear tensor of 10 elements, B = 5: blocks b0..b4 = [0,1] [2,3] [4,5] [6,7] [8,9]
DELTAS = [[2., 2., 4., 0., 0., 0., 0., 0., 0., 0.],   # A (n = 1) selected b0, b1 (its element 3 is a sent 0)
          [4., 4., 0., 0., 6., 6., 0., 0., 0., 0.],   # B (n = 2) selected b0, b2
          [8., 0., 2., 2., 0., 0., 5., 5., 0., 0.]]   # C (n = 1) selected b0, b1, b3 (its element 1 is a sent 0)
UNIONS = [[1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0]]
NS = [1, 2, 1]


@pytest.mark.parametrize("rule, expected", [
    # per element over the clients whose blocks hold it: e0 (2+8+8)/4, e1 (2+8+0)/4, b1 (A, C) e2 (4+2)/2 e3 (0+2)/2,
    # b2 (B) 6, b3 (C) 5, b4 nobody: 0
    ("index", [4.5, 2.5, 3.0, 1.0, 6.0, 6.0, 5.0, 5.0, 0.0, 0.0]),
    # per element over the non-zero updates: e1 (2+8)/3, e3 only C: 2
    ("ewa", [4.5, 10 / 3, 3.0, 2.0, 6.0, 6.0, 5.0, 5.0, 0.0, 0.0]),
    # (Δ_A + 2Δ_B + Δ_C)/4 everywhere
    ("fedavg", [4.5, 2.5, 1.5, 0.5, 3.0, 3.0, 1.25, 1.25, 0.0, 0.0]),
    # the code's --aggregate_sampled_clients 0: a fourth client (n = 4, not sampled) adds the old model: ÷ 8
    ("fedavg_all", [2.25, 1.25, 0.75, 0.25, 1.5, 1.5, 0.625, 0.625, 0.0, 0.0]),
])
def test_three_aggregation_rules_by_hand(rule: str, expected: list[float]) -> None:
    cb = PFedGate(aggregation="fedavg" if rule.startswith("fedavg") else rule,  # type: ignore[arg-type]
                  fedavg_weights="all" if rule == "fedavg_all" else "participants")
    cb.table = make_block_table([("w", (10,), True)], num_splits=5)
    glob = {"w": torch.ones(10)}
    sizes = {0: 1, 1: 2, 2: 1, 3: 4}
    loop = SimpleNamespace(global_state=glob, server_update=None, num_clients=4,
                           datamodule=SimpleNamespace(num_samples=lambda j, split: sizes[j]))
    loop.set_server_update = lambda update: setattr(loop, "server_update", update)  # (the view's one write here)
    updates = []
    for i, (d, u, n) in enumerate(zip(DELTAS, UNIONS, NS)):
        delta, keep = {"w": torch.tensor(d)}, torch.tensor(u, dtype=torch.bool)
        if rule == "index":
            message = Message(pack_blocks(delta, keep, cb.table), {BLOCKS: keep})
        elif rule == "ewa":
            message = Message(delta, {"w": delta["w"] != 0})
        else:
            message = Message({"w": glob["w"] + delta["w"]})
        updates.append(ClientUpdate(i, 0, n, {"w": glob["w"] + delta["w"]}, message))
    new = cb.aggregate(loop, updates)  # type: ignore[arg-type]
    torch.testing.assert_close(new["w"], torch.ones(10) + torch.tensor(expected))
    if rule in ("index", "ewa"):  # the server's update, recorded through the loop
        torch.testing.assert_close(loop.server_update["w"], torch.tensor(expected))
    if rule == "index":  # bytes: A sends 4 values + a 5-bit index (1 byte), B 4 + 1, C 6 + 1
        assert [u.message.nbytes() for u in updates] == [17, 17, 25]
    if rule == "ewa":  # non-zeros 3, 4, 5 (4 B each) + the cheaper index, a 2-byte bitmap
        assert [u.message.nbytes() for u in updates] == [14, 18, 22]


# ------------------------------------------------------------------------------------------------ s = 1

def test_density_one_is_dense_training_of_theta_times_m(tmp_path: Path) -> None:
    for variant in ("paper", "code"):
        cb = PFedGate(density=1.0, straight_through=variant, separate_paths=False)  # type: ignore[arg-type]
        loop = tiny_loop(tmp_path / variant, callbacks=[cb])
        module = tiny_module()
        loop.setup(module, tiny_datamodule())
        x, y = next(iter(loop.datamodule.train_loader(0, seed=1)))
        ref_gate = copy.deepcopy(cb.gate)  # the same weights, before the call below moves its BN statistics
        cb._load_gate(loop, 0)
        cb._install(module)
        try:
            logits = module(x)
        finally:
            cb._uninstall()
        F.cross_entropy(logits, y).backward()
        # by hand: M from the gate, repeated over every block of the split, θ' = M-scaled θ
        _, m = ref_gate(x, s_min=0.2)
        m = m.detach()
        owners = _block_owner()
        scales, scaled = {}, {}
        for name, p in module.named_parameters():
            first = owners.index(name)
            sizes = TINY_SIZES[first:first + owners.count(name)]
            scales[name] = torch.cat([m[first + j].expand(w) for j, w in enumerate(sizes)]).view_as(p)
            scaled[name] = (p.detach() * scales[name]).requires_grad_()
        out = torch.func.functional_call(copy.deepcopy(module), scaled, (x,))  # a dense model holding M-scaled θ
        torch.testing.assert_close(logits, out)
        F.cross_entropy(out, y).backward()
        for name, p in module.named_parameters():  # dL/dθ = expand(M) ⊙ dL/dθ' (every block kept)
            torch.testing.assert_close(p.grad, scales[name] * scaled[name].grad, rtol=1e-5, atol=1e-7)
        tally = cb._stats["batches"]
        assert fold_density(tally.numels().tolist(), tally.counts, tally.table.numel) / tally.n == 1.0  # s' = 1


def test_kept_blocks_reduced_at_the_end_equal_running_sums(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fit's kept blocks, kept batch by batch and reduced once (also in chunks, as a long fit folds them), give the
    running sums' numbers: per tensor Σ n_b · kept elements, the union, and the density's float64 terms in order."""
    import pl_fedsparse.callbacks.pfedgate as pg

    table = make_block_table([("a", (7, 3), True), ("b", (10,), True), ("c", (2, 2), False)], num_splits=4)
    gen = torch.Generator().manual_seed(3)
    masks = [torch.rand(table.num_blocks, generator=gen) < 0.5 for _ in range(11)]
    counts = [8, 8, 8, 3, 8, 8, 8, 3, 5, 8, 1]  # runs of equal counts, as epochs' last batches make them
    owner = [i for i, (b, e) in enumerate(table.spans) for _ in range(b, e)]
    kept = [0] * len(table.spans)
    density: float | None = None
    for m, n in zip(masks, counts):  # the running sums, by hand
        per = [0] * len(table.spans)
        for j, k in enumerate(m.tolist()):
            per[owner[j]] += table.sizes[j] * k
        kept = [a + p * n for a, p in zip(kept, per)]
        term = float(sum(per) * n) / table.numel
        density = term if density is None else density + term
    for chunk in (256, 3, 1):
        monkeypatch.setattr(pg._KeptBlocks, "CHUNK", chunk)
        tally = pg._KeptBlocks(table, fit=True, copy=False)
        for i, (m, n) in enumerate(zip(masks, counts)):
            tally.add(m, n, gate_trained=i % 2 == 0)
        got_kept, union = tally.totals()
        assert got_kept.tolist() == kept, chunk
        assert torch.equal(union, torch.stack(masks).any(0)), chunk
        assert fold_density(tally.numels().tolist(), tally.counts, table.numel) == density, chunk
        assert (tally.n, tally.gate_n) == (sum(counts), sum(counts[::2])), chunk


def test_a_fit_folding_its_kept_blocks_in_chunks_gives_the_same_run(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import pl_fedsparse.callbacks.pfedgate as pg

    def run(name: str) -> list[dict[str, Any]]:
        loop = tiny_loop(tmp_path / name, num_rounds=2, callbacks=[PFedGate(density=0.5)])
        loop.fit(tiny_module(), tiny_datamodule(num_clients=3, batch_size=11))
        return _rows(tmp_path / name)

    whole = run("whole")
    monkeypatch.setattr(pg._KeptBlocks, "CHUNK", 2)
    assert run("chunks") == whole
    assert any(r.get("gate_density") for r in whole) and any(r.get("gate_density_train") for r in whole)


def _block_owner() -> list[str]:
    names = ["backbone.layers.0.weight", "backbone.layers.0.bias", "backbone.layers.2.weight", "backbone.layers.2.bias"]
    counts = [5, 4, 5, 4]
    return [n for n, c in zip(names, counts) for _ in range(c)]


def test_density_one_keeps_every_block_and_index_equals_fedavg(tmp_path: Path) -> None:
    states = {}
    for rule in ("fedavg", "index"):
        loop = tiny_loop(tmp_path / rule, callbacks=[PFedGate(density=1.0, aggregation=rule)])  # type: ignore[arg-type]
        loop.fit(tiny_module(), tiny_datamodule())
        assert all(r["gate_density"] == 1.0 and r["gate_upload_ratio"] == 1.0 for r in loop.history)
        states[rule] = loop.global_state
    for k, v in states["fedavg"].items():  # every client sends every block: the index-wise mean is FedAvg's
        torch.testing.assert_close(states["index"][k], v, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------- precision, CLI

def test_bf16_mixed_trains_gates_in_float32(tmp_path: Path) -> None:
    loop = tiny_loop(tmp_path, num_rounds=1, precision="bf16-mixed", callbacks=[PFedGate(density=0.5)])
    loop.fit(tiny_module(), tiny_datamodule())
    row = loop.history[-1]
    assert math.isfinite(row["train_loss"]) and row["client_faults"] == 0 and 0 < row["gate_density"] <= 0.5
    gate = loop.client_store.get(0, "PFedGate/gate")
    assert all(t.dtype == torch.float32 for k, t in gate.items() if t.is_floating_point())


def test_cli_synthetic_pfedgate_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = fit_rows(["--config", str(REPO / "configs" / "synthetic_pfedgate.yaml"), "--trainer.num_rounds", "2",
                     "--trainer.eval_every", "1", "--data.num_clients", "4",
                     "--data.synthetic", '{"num_train": 1200, "num_test": 200}',
                     "--trainer.default_root_dir", str(tmp_path / "run")], capsys)
    assert len(rows) == 2 and rows[-1]["evaluated"]
    last = rows[-1]
    assert 0.2 <= last["gate_density"] <= 0.5 and last["gate_upload_ratio"] >= last["gate_density_train"]
    assert last["global_acc"] is not None and last["acc_bottom10"] is not None and last["acc_weighted"] is not None


@pytest.mark.parametrize("args, message", [
    ({"density": 0.0}, r"^PFedGate\.density=0\.0 is invalid: expected a density in \(0, 1\]"),
    ({"density": 0.1}, r"^PFedGate\.density=0\.1 is invalid: expected a density >= 0\.2 with split='equal'"),
    ({"client_densities": [0.5, 1.5]}, r"^PFedGate\.client_densities=1\.5 is invalid"),
    ({"split": "blocks"}, r"^PFedGate\.split='blocks' is invalid"),
    ({"s_min": 0.1}, r"^PFedGate\.s_min=0\.1 is invalid: expected null, or a number in \(0, 1\) with split: paper"),
    ({"aggregation": "mean"}, r"^PFedGate\.aggregation='mean' is invalid: expected 'fedavg'"),
    ({"straight_through": "hard"}, r"^PFedGate\.straight_through='hard' is invalid"),
    ({"gate_lr": 0}, r"^PFedGate\.gate_lr=0 is invalid: expected a number > 0"),
    ({"schedule": "alternate"}, r"^PFedGate\.schedule='alternate' is invalid"),
    ({"lr_milestones": [1.5]}, r"^PFedGate\.lr_milestones=\[1\.5\] is invalid"),
    ({"num_splits": 1}, r"^PFedGate\.num_splits=1 is invalid"),
])
def test_bad_options_are_one_line_errors(args: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        PFedGate(**args)
    assert "\n" not in str(info.value)


def test_bad_option_through_the_cli_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = (REPO / "configs" / "synthetic_pfedgate.yaml").read_text()
    assert "density: 0.5 " in text
    config = tmp_path / "bad.yaml"
    config.write_text(text.replace("density: 0.5 ", "density: 0.05 "))
    code, _, err = run_main(["fit", "--config", str(config), "--trainer.default_root_dir", str(tmp_path / "run")],
                            capsys)
    assert code != 0
    assert "PFedGate.density=0.05 is invalid" in one_line(err)


# ------------------------------------------------------------------------------------------- novel clients

@pytest.mark.parametrize("with_gate", [True, False])
def test_novel_clients_never_train_and_adapt_at_the_end(tmp_path: Path, with_gate: bool) -> None:
    spy = Spy()
    novel = NovelClients(fraction=0.25)
    callbacks: list[Any] = [PFedGate(density=0.5, gate_lr=1.0)] if with_gate else []
    loop = tiny_loop(tmp_path, num_rounds=2, callbacks=[*callbacks, novel, spy])
    loop.fit(tiny_module(), tiny_datamodule())
    assert len(novel.novel) == 1  # round(0.25 · 4)
    k = novel.novel[0]
    assert all(k not in [u.client_idx for u in updates] for updates in spy.rounds)  # it never trained
    assert all(len(updates) == 3 for updates in spy.rounds)  # join_ratio 1 of the 3 others
    tuned = loop.client_store.get(k, "NovelClients/weights")
    if with_gate:  # pFedGate adapts only the gate: θ frozen, the gate moved
        assert all(torch.equal(tuned[n], loop.global_state[n]) for n in tuned)
        cb = loop.callbacks[0]
        assert isinstance(cb, PFedGate)
        assert not torch.equal(loop.client_store.get(k, "PFedGate/gate")["gating.1.weight"],
                               cb._template["gating.1.weight"])
    else:  # other methods fine-tune the global model
        assert any(not torch.equal(tuned[n], loop.global_state[n]) for n in tuned)
    row = loop.history[-1]
    assert row["novel/gap"] == pytest.approx(row["seen/acc_weighted"] - row["novel/acc_weighted"])
    seen = [a for c, a in enumerate(loop.last_client_acc) if c != k]
    assert row["seen/acc_bottom10"] == pytest.approx(min(seen))  # 3 trained clients: ⌊3/10⌋ = 0, the worst
    assert row["comm_bytes_down"] == 4 * 4 * TINY_D  # 3 participants + the novel client's adaptation download


def test_novel_clients_bottom_decile_counts_only_the_clients_that_trained() -> None:
    novel = NovelClients(fraction=0.2)
    novel.novel = [3, 7]  # the two worst clients are novel: they must not be the seen clients' bottom decile
    accs = {k: 0.05 * k + 0.5 for k in range(12)}
    accs.update({3: 0.01, 7: 0.02})
    for k, a in accs.items():
        novel.on_client_evaluate_end(None, None, k, "personal", {"acc": a, "n": 10.0})  # type: ignore[arg-type]
    metrics: dict[str, Any] = {}
    novel.on_evaluation_end(None, metrics)  # type: ignore[arg-type]
    seen = sorted(a for k, a in accs.items() if k not in (3, 7))
    assert metrics["seen/acc_bottom10"] == pytest.approx(seen[1])  # 10 trained clients: ⌊10/10⌋ = 1, the 2nd worst


# ------------------------------------------------------------------------------------------- schedules

def test_bilevel_schedule_trains_the_gate_in_even_epochs_and_the_model_in_odd_ones(tmp_path: Path) -> None:
    initial = tiny_module().state_dict()
    one = tiny_loop(tmp_path / "one", num_rounds=1, local_epochs=1,
                    callbacks=[PFedGate(density=0.5, schedule="bilevel", gate_lr=1.0)])
    one.fit(tiny_module(), tiny_datamodule())
    assert all(torch.equal(one.global_state[k], v) for k, v in initial.items())  # epoch 0 trains only φ
    cb = one.callbacks[0]
    assert isinstance(cb, PFedGate)
    assert not torch.equal(one.client_store.get(0, "PFedGate/gate")["gating.1.weight"], cb._template["gating.1.weight"])
    two = tiny_loop(tmp_path / "two", num_rounds=1, local_epochs=2,
                    callbacks=[PFedGate(density=0.5, schedule="bilevel", gate_lr=1.0)])
    two.fit(tiny_module(), tiny_datamodule())
    assert any(not torch.equal(two.global_state[k], v) for k, v in initial.items())  # epoch 1 trains θ
    # the gate did not move in epoch 1: its state equals the one-epoch run's, except the BN/SN running statistics
    g1, g2 = one.client_store.get(0, "PFedGate/gate"), two.client_store.get(0, "PFedGate/gate")
    for k in ("gating.1.weight", "gating.1.bias", "norm_input.mean_weight"):
        assert torch.equal(g1[k], g2[k])


class LrSpy(FederatedCallback):
    scratch_attributes = ("seen",)  # test records, read in process only

    def __init__(self, gate: PFedGate) -> None:
        self.gate = gate
        self.seen: list[tuple[int, float, float]] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            ctx = self.gate._ctx
            assert ctx is not None and self.gate._gate_opt is not None
            self.seen.append((ctx.round_idx, trainer.optimizers[0].param_groups[0]["lr"],
                              self.gate._gate_opt.param_groups[0]["lr"]))


def test_lr_milestones_decay_both_learning_rates(tmp_path: Path) -> None:
    cb = PFedGate(density=0.5, gate_lr=2.0, lr_milestones=[0.5, 0.75], lr_gamma=0.1)
    spy = LrSpy(cb)
    tiny_loop(tmp_path, num_rounds=4, clients_per_round=1, callbacks=[cb, spy]).fit(tiny_module(), tiny_datamodule())
    # T = 4: milestones at rounds 2 and 3; the module's lr 0.1, the gate's 2.0
    expected = {0: (0.1, 2.0), 1: (0.1, 2.0), 2: (0.01, 0.2), 3: (0.001, 0.02)}
    assert [r for r, _, _ in spy.seen] == [0, 1, 2, 3]
    for r, lr, glr in spy.seen:
        assert lr == pytest.approx(expected[r][0]) and glr == pytest.approx(expected[r][1])
