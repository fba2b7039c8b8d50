"""The lossless client-state codec (issue 13, acceptance 5): bit-exact round trips, shared tensors stay shared, and
every method gives the same metrics and the same client state with ``trainer.client_state_codec: lossless``.

The tiny federation's tensors are smaller than :data:`floatcodec.MIN_NUMEL`, so the federation tests lower it: else
nothing would be encoded and the comparison would prove nothing (each test also checks that something was).
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import METHODS, TINY_CLI, fit_until_interrupted, run_main, tiny_datamodule, tiny_loop, tiny_module

from pl_fedsparse.callbacks import ElementwiseAggregation, PersonalizedDownstream, TopKUpload
from pl_fedsparse.client import ClientStateStore
from pl_fedsparse.errors import ConfigError
from pl_fedsparse.functional import floatcodec

CASES = {
    "weights": lambda: torch.randn(300, 70) * 0.05,
    "unit normal, odd size": lambda: torch.randn(12_345),
    "sparse trained model": lambda: torch.randn(8192) * (torch.rand(8192) < 0.5),
    "specials": lambda: torch.cat([torch.randn(5000) * 1e-3, torch.tensor(
        [0.0, -0.0, math.inf, -math.inf, math.nan, 1e-45, -1e-40, 3.4e38, float.fromhex("0x1.fffffep-127")])]),
    "wide range": lambda: torch.randn(6000) * torch.exp2(torch.randint(-120, 120, (6000,)).float()),
    "constant": lambda: torch.full((5000,), 0.25),
    "non-contiguous": lambda: torch.randn(100, 200).t()[:, ::2],
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("case", list(CASES))
def test_decode_gives_back_every_bit(case: str) -> None:
    torch.manual_seed(0)
    t = CASES[case]()
    enc = floatcodec.encode(t)
    out = floatcodec.decode(enc) if floatcodec.is_encoded(enc) else enc
    assert out.shape == t.shape and out.dtype == torch.float32
    assert torch.equal(_bits(out), _bits(t))


def test_weights_take_less_memory_and_incompressible_ones_are_kept_as_they_are() -> None:
    torch.manual_seed(0)
    w = torch.randn(100_000) * 0.02
    enc = floatcodec.encode(w)
    assert floatcodec.is_encoded(enc)
    assert floatcodec.encoded_nbytes(enc) < 3.5 * w.numel()  # vs 4 bytes raw
    noise = torch.randint(-2**31, 2**31 - 1, (100_000,), dtype=torch.int32).view(torch.float32)  # uniform bits
    assert floatcodec.encode(noise) is noise
    for t in (torch.randn(floatcodec.MIN_NUMEL - 1), torch.randn(10_000, dtype=torch.float64),
              torch.randint(0, 9, (10_000,))):
        assert floatcodec.encode(t) is t


def _store(codec: str) -> tuple[ClientStateStore, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    init = {"w": torch.randn(64, 128) * 0.1, "b": torch.zeros(64), "steps": torch.tensor(3)}
    store = ClientStateStore(codec)  # type: ignore[arg-type]
    store.declare("cb/weights", lambda k: dict(init))
    store.materialize(range(5))
    return store, init


def test_a_tensor_shared_by_every_client_is_encoded_once_and_an_update_is_not_lost() -> None:
    store, init = _store("lossless")
    held = [store.export_client(k)["cb/weights"]["w"] for k in range(5)]
    assert floatcodec.is_encoded(held[0]) and all(h is held[0] for h in held)
    assert store.nbytes() < 5 * (64 * 128 * 4)
    got = store.get(2, "cb/weights")
    assert torch.equal(got["w"], init["w"]) and got["w"] is not init["w"]
    store.set(2, "cb/weights", got)  # set back unchanged: the same encoded object, no copy
    assert store.export_client(2)["cb/weights"]["w"] is held[0]
    got["w"].mul_(2)  # changed in place, then set: must not be taken for the old value
    store.set(2, "cb/weights", got)
    assert torch.equal(store.get(2, "cb/weights")["w"], 2 * init["w"])
    assert torch.equal(store.get(3, "cb/weights")["w"], init["w"])


@pytest.mark.parametrize(("saved", "loaded"), [("lossless", "none"), ("none", "lossless"), ("lossless", "lossless")])
def test_checkpointed_state_loads_with_either_codec(saved: str, loaded: str) -> None:
    store, init = _store(saved)
    store.set(1, "cb/weights", {**init, "w": init["w"] + 1})
    buf = io.BytesIO()
    torch.save(store.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)  # no code runs at load: plain dicts of tensors
    other, _ = _store(loaded)
    other.load_state_dict(state)
    for k in range(5):
        a, b = store.get(k, "cb/weights"), other.get(k, "cb/weights")
        assert all(torch.equal(_bits(a[n].float()), _bits(b[n].float())) for n in a)
    held = other.export_client(1)["cb/weights"]["w"]
    assert floatcodec.is_encoded(held) == (loaded == "lossless")


def test_a_bad_codec_is_one_line_naming_the_parameter(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"trainer\.client_state_codec.*'zstd'.*none, lossless"):
        tiny_loop(tmp_path, client_state_codec="zstd")


FEDERATIONS: dict[str, tuple[Any, Any]] = {
    **METHODS,
    "fedpse": (lambda: [TopKUpload(sparsity=0.8), ElementwiseAggregation(), PersonalizedDownstream(sparsity=0.8)], None),
}


def _fit(tmp_path: Path, method: str, codec: str, **kw: Any) -> Any:
    make, topo = FEDERATIONS[method]
    loop = tiny_loop(tmp_path / codec, callbacks=make(), topology=topo() if topo else None,
                     client_state_codec=codec, **kw)
    loop.fit(tiny_module(), tiny_datamodule())
    return loop


def _rows(run: Path) -> list[dict[str, Any]]:
    return [{k: v for k, v in json.loads(x).items() if not k.startswith("time")}
            for x in (run / "metrics.jsonl").read_text().splitlines()]


def _any_encoded(tree: Any) -> bool:
    if floatcodec.is_encoded(tree):
        return True
    return isinstance(tree, dict) and any(_any_encoded(v) for v in tree.values())


@pytest.mark.parametrize("method", list(FEDERATIONS))
@pytest.mark.slow
def test_every_method_gives_the_same_run_with_the_lossless_codec(tmp_path: Path, method: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(floatcodec, "MIN_NUMEL", 16)
    plain = _fit(tmp_path, method, "none", num_rounds=3)
    packed = _fit(tmp_path, method, "lossless", num_rounds=3)
    floats = [t for t in _flatten(plain.client_store.state_dict()).values() if t.dtype == torch.int32]
    assert _any_encoded(packed.client_store.state_dict()) == bool(floats)  # (FedSpa keeps only masks)
    assert _rows(tmp_path / "lossless") == _rows(tmp_path / "none")
    for k in range(plain.num_clients):
        for key in plain.client_store.keys:
            a, b = plain.client_store.get(k, key), packed.client_store.get(k, key)
            flat_a, flat_b = _flatten(a), _flatten(b)
            assert flat_a.keys() == flat_b.keys()
            assert all(torch.equal(flat_a[n], flat_b[n]) for n in flat_a), (method, k, key)


def _flatten(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Leaves by path; float32 ones as their bits (int32), so that NaNs and signed zeros compare too."""
    if isinstance(tree, dict):
        return {n: t for k, v in tree.items() for n, t in _flatten(v, f"{prefix}{k}/").items()}
    return {prefix: tree.view(torch.int32) if tree.dtype == torch.float32 else tree}


def test_a_lossless_run_resumed_without_the_codec_is_the_uninterrupted_run(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(floatcodec, "MIN_NUMEL", 16)
    make, topo = FEDERATIONS["dispfl"]
    _fit(tmp_path / "full", "dispfl", "none", num_rounds=4)
    run = tmp_path / "cut"
    stopped = tiny_loop(run, num_rounds=4, callbacks=make(), topology=topo(), client_state_codec="lossless")
    fit_until_interrupted(stopped, 2, tiny_module(), tiny_datamodule())
    ckpt = run / "checkpoints" / "last.ckpt"
    assert _any_encoded(torch.load(ckpt, weights_only=True)["client_store"])
    resumed = tiny_loop(run, num_rounds=4, callbacks=make(), topology=topo())  # codec "none" now
    resumed.fit(tiny_module(seed=1), tiny_datamodule(), ckpt_path=str(ckpt))
    assert _rows(run) == _rows(tmp_path / "full" / "none")


def test_gossips_round_snapshot_holds_the_encoded_state_not_decoded_copies(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # decoding every client's model at the start of a round would hold all of them twice: 1,000 ResNet18 clients
    monkeypatch.setattr(floatcodec, "MIN_NUMEL", 16)
    loop = _fit(tmp_path, "dispfl", "lossless", num_rounds=1)
    gossip = next(cb for cb in loop.callbacks if type(cb).__name__ == "Gossip")
    gossip.on_round_start(loop, 1)
    for k in range(loop.num_clients):
        weights, _ = gossip._snapshot[k]
        assert weights is loop.client_store.export_client(k)["Gossip/weights"]
        assert _any_encoded(weights)
    sent = gossip.sender_message(0).tensors
    expected = loop.personal_state(0)
    assert all(torch.equal(sent[n], expected[n]) for n in expected)


@pytest.mark.parametrize("codec", ["none", "lossless"])
def test_the_store_hands_free_heap_pages_back_after_every_release_every_bytes(codec: str,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import pl_fedsparse.client as client_module

    calls: list[int] = []
    monkeypatch.setattr(client_module, "release_free_memory", lambda: calls.append(1) or True)
    store, init = _store(codec)
    monkeypatch.setattr(store, "release_every", 100_000)
    sizes = []
    for r in range(10):
        for k in range(5):
            kept = {n: t + r + 1 if t.is_floating_point() else t for n, t in init.items()}  # new tensors each time
            store.set(k, "cb/weights", kept)
            sizes.append(client_module._nbytes(store.export_client(k)["cb/weights"]))
    # a release once 100,000 bytes were stored since the last one: between total / (100,000 + one set) and
    # total / 100,000 of them
    total, n = sum(sizes), len(calls)
    assert total // (100_000 + max(sizes)) <= n <= total // 100_000 and n > 0
    monkeypatch.setattr(store, "release_every", 0)  # 0: never
    store.set(0, "cb/weights", {**init, "w": init["w"] * 3})
    assert len(calls) == n


def test_release_free_memory_runs_on_this_libc() -> None:
    from pl_fedsparse.allocator import release_free_memory

    assert release_free_memory() in (True, False)  # False only off glibc; never raises


def test_the_cli_may_turn_the_codec_on_when_resuming(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the way a run that outgrew the memory is continued: the same numbers, so not a configuration change
    def fit(run: Path, *extra: str) -> None:
        code, _, err = run_main(["fit", *TINY_CLI, "--trainer.default_root_dir", str(run), *extra], capsys)
        assert code == 0, err

    fit(tmp_path / "full", "--trainer.num_rounds", "3")
    run = tmp_path / "run"
    fit(run, "--trainer.num_rounds", "1")
    fit(run, "--trainer.num_rounds", "3", "--trainer.client_state_codec", "lossless",
        "--ckpt_path", str(run / "checkpoints" / "last.ckpt"))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumes"] == [{"round": 1, "changed": {"trainer.num_rounds": [1, 3],
                                                           "trainer.client_state_codec": ["none", "lossless"]}}]
    assert _rows(run) == _rows(tmp_path / "full")
    code, _, err = run_main(["fit", *TINY_CLI, "--trainer.default_root_dir", str(tmp_path / "bad"),
                             "--trainer.client_state_codec", "zstd"], capsys)
    assert code != 0 and "client_state_codec" in err.strip().splitlines()[-1]
