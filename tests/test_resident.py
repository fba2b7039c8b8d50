"""Device copies kept between fits (``trainer.device_state_budget``, :mod:`pl_fedsparse.functional.resident`): what is
on the device already does not cross the link again — a copy is handed out only while its host tensor is alive and
unchanged, within the budget — and a run's numbers do not change (a device run simulated on the CPU)."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

from pl_fedsparse.errors import ConfigError
from pl_fedsparse.functional import resident
from pl_fedsparse.functional.resident import ResidentCopies, device_budget, parse_budget
from pl_fedsparse.testing import simulated_device

REPO = Path(__file__).resolve().parents[1]


def test_a_copy_is_found_while_its_host_tensor_is_alive_and_unchanged() -> None:
    cache = ResidentCopies(budget=1 << 20)
    host, copy = torch.arange(4.0), torch.arange(4.0)
    cache.keep(host, copy)
    assert cache.lookup(host, "cpu") is copy and cache.hits == 1
    assert cache.lookup(torch.arange(4.0), "cpu") is None  # equal values, another tensor: not found
    host.add_(1)  # changed in place on the host: the copy is stale
    assert cache.lookup(host, "cpu") is None and len(cache) == 0 and cache.used == 0
    cache.keep(host, copy)
    copy.mul_(2)  # the copy changed (whoever holds it): stale too
    assert cache.lookup(host, "cpu") is None
    cache.keep(host, copy)
    assert cache.lookup(host, "meta") is None  # on another device than the one asked for
    cache.keep(host, copy)
    del host
    gc.collect()
    assert len(cache) == 0 and cache.used == 0  # the host tensor is gone: so is its copy


def test_the_budget_counts_storages_once_and_drops_the_least_recently_used() -> None:
    hosts = [torch.zeros(64) for _ in range(4)]  # 256 bytes each
    cache = ResidentCopies(budget=600)
    for h in hosts[:2]:
        cache.keep(h, h.clone())
    assert cache.used == 512
    assert cache.lookup(hosts[0], "cpu") is not None  # hosts[0] is now the most recently used
    cache.keep(hosts[2], hosts[2].clone())  # over the budget: hosts[1]'s copy goes
    assert cache.used == 512 and cache.lookup(hosts[1], "cpu") is None
    assert cache.lookup(hosts[0], "cpu") is not None and cache.lookup(hosts[2], "cpu") is not None
    buf = torch.zeros(128)  # two copies that are views of one buffer: its 512 bytes counted once
    cache = ResidentCopies(budget=600)
    cache.keep(hosts[0], buf[:64])
    cache.keep(hosts[1], buf[64:])
    assert cache.used == 512 and len(cache) == 2
    cache.keep(hosts[3], torch.zeros(200))  # 800 bytes: more than the whole budget, not kept (nothing dropped)
    assert len(cache) == 2 and cache.lookup(hosts[3], "cpu") is None
    off = ResidentCopies(budget=0)
    off.keep(hosts[0], hosts[0].clone())
    assert len(off) == 0 and off.lookup(hosts[0], "cpu") is None and not off.active


@pytest.mark.parametrize("value, expected", [(0, 0), (1024, 1024), ("0", 0), ("512MiB", 512 << 20), ("2GB", 2 * 10**9),
                                             ("1.5 GiB", 3 << 29), ("auto", None), ("AUTO", None), ("64kb", 64000)])
def test_budget_values(value: object, expected: int | None) -> None:
    assert parse_budget(value) == expected


@pytest.mark.parametrize("value", [-1, "-1MiB", "lots", "5 parsecs", True, 1.5, None, "nanGB", "infGiB"])
def test_a_bad_budget_is_one_line_naming_the_option(value: object, tmp_path: Path) -> None:
    from conftest import tiny_loop

    with pytest.raises(ConfigError, match=r"^trainer\.device_state_budget=.* is invalid: expected auto, a number of "
                                          r"bytes >= 0 or a size such as 512MiB or 2GB$"):
        tiny_loop(tmp_path, device_state_budget=value)


def test_auto_is_nothing_on_the_cpu_and_some_in_a_simulated_device_run() -> None:
    assert device_budget("auto", "cpu") == 0
    assert device_budget("3MiB", "cpu") == 3 << 20
    with simulated_device():
        assert device_budget("auto", "cpu") == resident.AUTO_BUDGET_ON_CPU > 0
        assert device_budget(0, "cpu") == 0


def _run(tmp_path: Path, budget: str, capsys: pytest.CaptureFixture[str], config: str = "tiny") -> tuple:
    """``config`` (``benchmarks/device_traffic.py``'s, or ``"tiny"``: FedAvg on the tests' tiny task) as a device run
    simulated on the CPU: the metrics, and the loop's store's device copies (with their hits)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import device_traffic
    from conftest import TINY_CLI, metric_rows, run_main

    from pl_fedsparse.client import ClientStateStore

    stores: list[ClientStateStore] = []
    made = ClientStateStore.__init__

    def init(self: ClientStateStore, *a: object, **k: object) -> None:
        made(self, *a, **k)
        stores.append(self)

    run = tmp_path / f"{config}_{budget}"
    common = ["--trainer.eval_every", "1", "--trainer.enable_progress_bar", "false", "--trainer.on_client_fault",
              "raise", "--trainer.device_state_budget", budget, "--trainer.default_root_dir", str(run)]
    if config == "tiny":  # (FedAvg on the tests' tiny task: 4 clients, every one in every round)
        args = ["fit", *TINY_CLI, "--trainer.num_rounds", "3", *common]
    else:
        cfg, extra = device_traffic.CONFIGS[config]
        args = ["fit", "--config", cfg, *extra, *common]
        if "--trainer.num_rounds" not in extra:
            args += ["--trainer.num_rounds", "3"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ClientStateStore, "__init__", init)
        with simulated_device():
            code, _, err = run_main(args, capsys)
    assert code == 0, err
    return metric_rows(run), stores[-1].resident


@pytest.mark.parametrize("config", ["tiny", pytest.param("fedavg", marks=pytest.mark.slow),
                                    pytest.param("dmpfl", marks=pytest.mark.slow)])
def test_copies_kept_on_the_device_change_no_number_and_are_found(config: str, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """The server's weights cross once a round and the fits of the round find them; a store entry a fit wrote is
    found by the client's next fit (DM-PFL's personal state) — with the numbers of a run that keeps nothing."""
    monkeypatch.chdir(REPO)
    kept, cache = _run(tmp_path, "auto", capsys, config)
    plain, off = _run(tmp_path, "0", capsys, config)
    assert kept == plain
    assert cache.hits > 0 and cache.used <= cache.budget
    assert off.hits == 0 and not off.active


def test_a_tiny_budget_keeps_less_and_changes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A budget smaller than one copy of the weights: nothing is kept (and nothing breaks)."""
    monkeypatch.chdir(REPO)
    kept, cache = _run(tmp_path, "64", capsys)
    plain, _ = _run(tmp_path, "0", capsys)
    assert kept == plain and cache.hits == 0 and cache.used <= 64


def test_the_cli_takes_a_budget_and_a_resume_may_change_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A speed and memory setting: the same numbers, so a resume may set another (recorded as a change), and a bad
    value stops ``pl-fed`` with one line naming it."""
    import json

    from conftest import TINY_CLI, metric_rows, run_main

    def fit(run: Path, *extra: str) -> None:
        code, _, err = run_main(["fit", *TINY_CLI, "--trainer.default_root_dir", str(run), *extra], capsys)
        assert code == 0, err

    fit(tmp_path / "full", "--trainer.num_rounds", "3")
    run = tmp_path / "run"
    fit(run, "--trainer.num_rounds", "1", "--trainer.device_state_budget", "0")
    fit(run, "--trainer.num_rounds", "3", "--trainer.device_state_budget", "2GiB",
        "--ckpt_path", str(run / "checkpoints" / "last.ckpt"))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumes"] == [{"round": 1, "changed": {"trainer.num_rounds": [1, 3],
                                                           "trainer.device_state_budget": [0, "2GiB"]}}]
    assert metric_rows(run) == metric_rows(tmp_path / "full")
    code, _, err = run_main(["fit", *TINY_CLI, "--trainer.default_root_dir", str(tmp_path / "bad"),
                             "--trainer.device_state_budget", "lots"], capsys)
    last = err.strip().splitlines()[-1]
    assert code != 0 and "trainer.device_state_budget='lots' is invalid" in last, err
