"""Peer topologies, sparse gossip (DisPFL Alg. 1 line 7), D-PSGD, dropping and per-link accounting."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import tiny_datamodule, tiny_loop, tiny_module
from pl_fedsparse import ConfigError, FullyConnected, RandomPeers, Ring
from pl_fedsparse.callbacks import FineTune, Gossip, LocalTraining, RandomRegrow
from pl_fedsparse.functional import pack_masks


def _loop(tmp_path: Path, topology, callbacks, rounds: int = 1, **kw):  # type: ignore[no-untyped-def]
    return tiny_loop(tmp_path, num_rounds=rounds, topology=topology, callbacks=callbacks, **kw)


def test_gossip_average_on_hand_made_masks(tmp_path: Path) -> None:
    gossip = Gossip()
    loop = _loop(tmp_path, FullyConnected(), [gossip])
    loop.fit(tiny_module(), tiny_datamodule(num_clients=3))
    name = next(k for k, v in loop.initial_state.items() if v.ndim == 2)
    shape = loop.initial_state[name].shape
    vals = [torch.full(shape, float(v)) for v in (1.0, 3.0, 8.0)]
    masks = [torch.zeros(shape, dtype=torch.bool) for _ in range(3)]
    masks[0][0, 0] = masks[1][0, 0] = masks[2][0, 0] = True   # held by all: (1 + 3 + 8) / 3
    masks[0][0, 1] = masks[1][0, 1] = True                    # held by 0 and 1: (1 + 3) / 2
    masks[0][0, 2] = True                                     # held by client 0 alone: its own value
    #                                                          [0, 3] held by nobody: 0
    for j in range(3):
        state = dict(loop.initial_state)
        state[name] = vals[j] * masks[j]
        gossip.set_client_state(loop, j, "weights", state)
        gossip.set_client_state(loop, j, "mask", pack_masks({name: masks[j]}))
    gossip.on_round_start(loop, 1)
    out = gossip.client_message(loop, 0).tensors[name]  # type: ignore[union-attr]
    assert out[0, 0] == pytest.approx(4.0) and out[0, 1] == pytest.approx(2.0)
    assert out[0, 2] == pytest.approx(1.0) and out[0, 3] == 0.0
    # dense tensors (no mask) are plain means over the three clients
    other = next(k for k in loop.initial_state if k != name)
    torch.testing.assert_close(gossip.client_message(loop, 0).tensors[other], loop.initial_state[other])  # type: ignore[union-attr]


def test_all_ones_dispfl_round_equals_dpsgd(tmp_path: Path) -> None:
    dis = _loop(tmp_path / "d", FullyConnected(), [RandomRegrow(density=1.0, mask_personal_eval=False), Gossip()],
                rounds=2)
    dis.fit(tiny_module(), tiny_datamodule())
    dp = _loop(tmp_path / "p", FullyConnected(), [Gossip()], rounds=2)
    dp.fit(tiny_module(), tiny_datamodule())
    for k in range(4):
        a, b = dis.personal_state(k), dp.personal_state(k)
        assert all(torch.equal(a[n], b[n]) for n in a)


def test_topology_degrees() -> None:
    ring = Ring()
    for k in range(7):
        nb = ring.neighbors(0, k, range(7), seed=0)
        assert sorted(nb) == sorted({(k - 1) % 7, (k + 1) % 7})
    rp = RandomPeers(k=3)
    g0, g1 = rp.graph(0, 12, seed=1), rp.graph(1, 12, seed=1)
    for c, pulls in g0.items():
        assert len(pulls) == 3 and len(set(pulls)) == 3 and c not in pulls
    assert g0 != g1 and g0 == RandomPeers(k=3).graph(0, 12, seed=1)  # redrawn per round, seeded
    capped = RandomPeers(k=3, max_out_degree=3).graph(0, 12, seed=1)
    served = torch.bincount(torch.tensor([j for p in capped.values() for j in p]), minlength=12)
    assert int(served.max()) <= 3 and all(len(p) == 3 for p in capped.values())
    full = FullyConnected()
    assert len(full.neighbors(0, 0, range(5), seed=0)) == 4
    with pytest.raises(ConfigError, match="topology.k"):
        RandomPeers(k=5).graph(0, 5, seed=0)


def test_processing_order_does_not_matter(tmp_path: Path) -> None:
    def run(d: Path, order: list[int]):  # type: ignore[no-untyped-def]
        loop = _loop(d, RandomPeers(k=2), [RandomRegrow(density=0.5, same_mask=False, mask_personal_eval=False),
                                          Gossip()], rounds=2)
        loop.select_clients = lambda r: list(order)  # type: ignore[method-assign]
        loop.fit(tiny_module(), tiny_datamodule())
        return loop

    a, b = run(tmp_path / "a", [0, 1, 2, 3]), run(tmp_path / "b", [3, 1, 0, 2])
    for k in range(4):
        x, y = a.personal_state(k), b.personal_state(k)
        assert all(torch.equal(x[n], y[n]) for n in x)


def test_dropped_clients_offline_and_reference_modes(tmp_path: Path) -> None:
    topo = RandomPeers(k=2, drop_prob=0.5)
    gone = topo.dropped(0, 4, seed=0)
    assert gone, "pick a seed with at least one dropped client"
    loop = _loop(tmp_path / "o", topo, [Gossip()])
    loop.fit(tiny_module(), tiny_datamodule())
    assert loop.select_clients(0) == [k for k in range(4) if k not in gone]
    for k in range(4):
        assert not set(topo.neighbors(0, k, range(4), seed=0)) & gone
    for k in gone:  # offline: never trained, still the initial model
        assert all(torch.equal(loop.personal_state(k)[n], loop.initial_state[n]) for n in loop.initial_state)

    ref = RandomPeers(k=2, drop_prob=0.5, drop_mode="reference")
    assert ref.dropped(0, 4, seed=0) == set()  # everyone trains
    assert all(ref.skips_aggregation(0, k, 4, seed=0) == (k in gone) for k in range(4))
    g = Gossip()
    rl = _loop(tmp_path / "r", ref, [g])
    rl.fit(tiny_module(), tiny_datamodule())
    g.on_round_start(rl, 0)
    rl.round_idx = 0
    k = min(gone)
    own = g.get_client_state(rl, k, "weights")
    msg = g.client_message(rl, k)
    assert all(torch.equal(msg.tensors[n], own[n]) for n in own)  # type: ignore[union-attr]


def test_per_link_bytes_and_busiest_node(tmp_path: Path) -> None:
    loop = _loop(tmp_path, Ring(), [Gossip()], rounds=1)
    summary = loop.fit(tiny_module(), tiny_datamodule())
    model_bytes = sum(4 * v.numel() for v in loop.initial_state.values())
    # 4 clients x 2 pulls of a dense model; each transfer counted once; every node sends 2 and receives 2
    assert summary["comm_cum_bytes_total"] == 8 * model_bytes
    assert summary["final"]["comm_busiest_node_bytes"] == 4 * model_bytes
    assert summary["final"]["global_acc"] is None


def test_dpsgd_ft_fine_tunes_the_consensus_model(tmp_path: Path) -> None:
    ft = FineTune(epochs=1, start="consensus")
    loop = _loop(tmp_path, Ring(), [Gossip(), ft], rounds=2)
    summary = loop.fit(tiny_module(), tiny_datamodule())
    assert summary["comm_cum_bytes_total"] == 2 * 8 * sum(4 * v.numel() for v in loop.initial_state.values())
    w = ft.get_client_state(loop, 0, "weights")
    assert any(not torch.equal(w[n], loop.personal_state(0)[n]) for n in w)


def test_dpsgd_ft_starts_every_fine_tuning_from_the_uniform_consensus(tmp_path: Path) -> None:
    """DisPFL code's D-PSGD-FT: every client fine-tunes the plain average of all clients' models (not its own)."""
    from pl_fedsparse import FederatedCallback

    starts: dict[int, dict] = {}

    class Grab(FederatedCallback):
        def on_client_fit_start(self, loop, module, context):  # type: ignore[no-untyped-def]
            if context.kind == "finetune":
                starts[context.client_idx] = {n: t.detach().clone() for n, t in module.state_dict().items()}

    loop = _loop(tmp_path, Ring(), [Gossip(), FineTune(epochs=1, start="consensus"), Grab()], rounds=2)
    loop.fit(tiny_module(), tiny_datamodule())
    assert sorted(starts) == list(range(loop.num_clients))
    personal = [loop.personal_state(k) for k in range(loop.num_clients)]
    for k, start in starts.items():
        for n in loop.initial_state:
            consensus = sum(p[n].double() for p in personal) / len(personal)
            torch.testing.assert_close(start[n].double(), consensus, rtol=1e-6, atol=1e-7)
        assert any(not torch.equal(start[n], personal[k][n]) for n in loop.initial_state)  # not its own model


def test_gossip_needs_a_peer_topology(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="trainer.topology=Star is invalid for Gossip"):
        tiny_loop(tmp_path, num_rounds=1, callbacks=[Gossip()]).fit(tiny_module(), tiny_datamodule())


def test_local_is_unaffected_by_peer_topology(tmp_path: Path) -> None:
    s = _loop(tmp_path, Ring(), [LocalTraining()]).fit(tiny_module(), tiny_datamodule())
    assert s["comm_cum_bytes_total"] == 0


def test_dpsgd_clients_start_from_the_neighbourhood_average(tmp_path: Path) -> None:
    starts: dict[int, dict] = {}

    from pl_fedsparse import FederatedCallback

    class Grab(FederatedCallback):
        def on_client_fit_start(self, loop, module, context):  # type: ignore[no-untyped-def]
            if context.round_idx == 1:
                starts[context.client_idx] = {n: t.detach().clone() for n, t in module.state_dict().items()}

    g = Gossip()
    loop = _loop(tmp_path / "g", Ring(), [g, Grab()], rounds=2)
    loop.fit(tiny_module(), tiny_datamodule())
    local = _loop(tmp_path / "l", Ring(), [LocalTraining()], rounds=2)
    local.fit(tiny_module(), tiny_datamodule())
    assert any(not torch.equal(loop.personal_state(0)[n], local.personal_state(0)[n]) for n in loop.initial_state)
    # round 1 starts from the mean of the client's and its two ring neighbours' round-0 models
    ref = _loop(tmp_path / "r", Ring(), [Gossip()], rounds=1)
    ref.fit(tiny_module(), tiny_datamodule())
    for k in range(4):
        group = [ref.personal_state(j) for j in (k, (k - 1) % 4, (k + 1) % 4)]
        for n in starts[k]:
            torch.testing.assert_close(starts[k][n], sum(s[n] for s in group) / 3)


def test_partial_sampling_picks_only_clients_that_are_not_dropped(tmp_path: Path) -> None:
    """Sampling draws among the available clients and returns their ids (not positions in the available list)."""
    topo = RandomPeers(k=1, drop_prob=0.4)
    loop = _loop(tmp_path, topo, [Gossip()])
    loop.clients_per_round = 2
    loop.setup(tiny_module(), tiny_datamodule(num_clients=8))
    checked = 0
    for r in range(20):
        gone = topo.dropped(r, 8, seed=loop.seed)
        picked = loop.select_clients(r)
        assert len(picked) == min(2, 8 - len(gone)) and not set(picked) & gone, (r, picked, gone)
        checked += bool(gone and picked)
    assert checked > 5


def test_dpsgd_ft_every_fine_tunes_on_the_papers_schedule_without_changing_training(tmp_path: Path) -> None:
    """DisPFL's D-PSGD-FT fine-tunes the consensus every 100 rounds (``every``); the fine-tuned models are only
    evaluated, so the clients' training — losses, traffic, every model — is the same as with one fine-tuning after
    the last round, and the last fine-tuning gives the same models."""
    from pl_fedsparse import FederatedCallback

    def run(d: str, every: int | None) -> tuple[Any, FineTune, list[int], list[dict[str, Any]]]:
        rounds: list[int] = []

        class Spy(FederatedCallback):
            def on_client_fit_start(self, loop, module, context):  # type: ignore[no-untyped-def]
                if context.kind == "finetune" and context.client_idx == 0:
                    rounds.append(loop.round_idx)

        ft = FineTune(epochs=1, every=every, start="consensus")
        loop = _loop(tmp_path / d, RandomPeers(k=2), [Gossip(), ft, Spy()], rounds=5, eval_every=1)
        loop.fit(tiny_module(), tiny_datamodule())
        rows = [json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
        return loop, ft, rounds, rows

    end, ft_end, rounds_end, rows_end = run("end", None)
    sched, ft_sched, rounds_sched, rows_sched = run("every", 2)
    assert rounds_end == [4] and rounds_sched == [1, 3, 4]  # after rounds 2, 4 and the last (0-based 1, 3, 4)
    keep = ("train_loss", "comm_cum_bytes_total", "comm_bytes_per_link", "num_participants")
    assert [{k: r.get(k) for k in keep} for r in rows_sched] == [{k: r.get(k) for k in keep} for r in rows_end]
    # before the first fine-tuning both report the clients' own (D-PSGD) models
    assert rows_sched[0]["acc_mean"] == rows_end[0]["acc_mean"]
    for k in range(end.num_clients):
        a, b = sched.personal_state(k), end.personal_state(k)
        assert all(torch.equal(a[n], b[n]) for n in a)
        a, b = ft_sched.get_client_state(sched, k, "weights"), ft_end.get_client_state(end, k, "weights")
        assert all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("every", [0, -100, 1.5, True, "100"])
def test_fine_tune_every_must_be_a_positive_int(every: Any) -> None:
    with pytest.raises(ConfigError, match=r"FineTune.every=.* is invalid.*an int >= 1 or null"):
        FineTune(every=every)
