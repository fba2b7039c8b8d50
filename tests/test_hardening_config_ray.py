"""Hardening: a local Ray instance listens on loopback only; an unsafe checkpoint is refused without advice to turn
the check off; an empty or non-mapping ``--config`` file is one line naming the file."""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tiny_datamodule, tiny_loop, tiny_module

from pl_fedsparse import cli, shipped
from pl_fedsparse.errors import CheckpointError, ConfigError
from pl_fedsparse.run.checkpoint import load_checkpoint, save_checkpoint


# ------------------------------------------------------------------------------------------------ Ray on loopback
def _listening_inodes() -> dict[int, tuple[str, int]]:
    """``{socket inode: (address, port)}`` of every listening TCP socket of this machine (``/proc/net/tcp*``)."""
    out: dict[int, tuple[str, int]] = {}
    for family, table in ((socket.AF_INET, "/proc/net/tcp"), (socket.AF_INET6, "/proc/net/tcp6")):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != "0A":  # TCP_LISTEN
                continue
            hexip, hexport = fields[1].split(":")
            raw = bytes.fromhex(hexip)  # 32-bit words in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            out[int(fields[9])] = (socket.inet_ntop(family, raw), int(hexport, 16))
    return out


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _session_pids(marker: str) -> set[int]:
    """This process, its descendants (GCS, raylet, workers) and every process whose command line names the Ray
    session ``marker``."""
    pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
    parents = {p: _parent(p) for p in pids}
    found = {os.getpid()}
    grew = True
    while grew:
        grew = False
        for p, pp in parents.items():
            if pp in found and p not in found:
                found.add(p)
                grew = True
    return found | {p for p in pids if marker in _cmdline(p)}


def _listening(pids: set[int]) -> set[tuple[int, str, int]]:
    """``(pid, address, port)`` of the listening TCP sockets held by ``pids``."""
    inodes = _listening_inodes()
    out = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:[") and int(link[8:-1]) in inodes:
                out.add((pid, *inodes[int(link[8:-1])]))
    return out


def _is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:  # ::ffff:127.0.0.1
        ip = ip.ipv4_mapped
    return ip.is_loopback


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.slow
def test_a_local_ray_instance_listens_on_loopback_only(tmp_path: Path) -> None:
    ray = pytest.importorskip("ray")
    from pl_fedsparse.executors import RayExecutor

    if ray.is_initialized():  # the executor must start its own instance
        ray.shutdown()
    before = _listening({os.getpid()})  # whatever this test process listened on already is not Ray's
    seen: list[set[tuple[int, str, int]]] = []

    class Probe(RayExecutor):
        """Lists the session's listening sockets once the workers are up, and again while a round's fits run."""

        def _probe(self) -> None:
            node = ray._private.worker._global_node
            marker = os.path.basename(node.get_session_dir_path())
            seen.append(_listening(_session_pids(marker)) - before)

        def setup(self, loop: Any) -> None:
            super().setup(loop)
            assert self._started_ray, "the executor was to start a local instance itself"
            self._probe()

        def run(self, requests: Any) -> Any:
            out = super().run(requests)
            self._probe()
            return out

    loop = tiny_loop(tmp_path, executor=Probe(num_workers=2), num_rounds=1)
    try:
        loop.fit(tiny_module(), tiny_datamodule())
    finally:
        if ray.is_initialized():
            ray.shutdown()
    assert seen and all(seen), "no listening socket of the Ray session was found"
    sockets = set().union(*seen)
    pids = {pid for pid, _, _ in sockets}
    assert len(pids) >= 4, sockets  # at least GCS, raylet, driver and the two workers' servers were listed
    exposed = sorted(s for s in sockets if not _is_loopback(s[1]))
    assert not exposed, f"Ray listens beyond loopback: {exposed}"
    assert not ray.is_initialized()


def test_an_explicit_address_keeps_the_cluster_network_settings(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    ray = pytest.importorskip("ray")
    from ray._private import ray_constants

    from pl_fedsparse.executors import RayExecutor

    calls: list[dict[str, Any]] = []

    def fake_init(**kw: Any) -> None:
        calls.append({**kw, "cluster_flag": ray_constants.ENABLE_RAY_CLUSTER})
        raise ConnectionError("stop here")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", fake_init)
    flag = ray_constants.ENABLE_RAY_CLUSTER
    for address in (None, "auto"):
        with pytest.raises(ConfigError):
            RayExecutor(address=address).setup(tiny_loop(tmp_path))
    local, remote = calls
    assert local["address"] == "local" and local["_node_ip_address"] == "127.0.0.1"
    assert local["cluster_flag"] is False and ray_constants.ENABLE_RAY_CLUSTER == flag  # restored after init
    assert remote["address"] == "auto" and "_node_ip_address" not in remote and remote["cluster_flag"] == flag


# ------------------------------------------------------------------------------------------------ checkpoints
class _Payload:
    def __reduce__(self) -> Any:
        return (os.system, ("echo pwned",))


def test_an_unsafe_checkpoint_is_refused_without_advice_to_disable_the_check(tmp_path: Path) -> None:
    path = tmp_path / "evil.ckpt"
    torch.save({"format": "pl_fedsparse", "payload": _Payload()}, path)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    text = str(info.value)
    assert "\n" not in text and "\x1b" not in text
    assert text.startswith(f"ckpt_path={str(path)!r} is invalid: ")
    assert "found a pickled Python object (" in text and "system" in text
    assert "never executes code from a checkpoint" in text
    for advice in ("weights_only", "trust", "add_safe_globals", "can still be loaded"):
        assert advice not in text, advice


def test_a_corrupted_checkpoint_is_still_reported_as_corrupted(tmp_path: Path) -> None:
    good = tmp_path / "good.ckpt"
    save_checkpoint(good, {"round": 1})
    assert load_checkpoint(good)["round"] == 1
    for content in (good.read_bytes()[:100], b"not a checkpoint at all"):  # truncated; bytes that are no pickle
        bad = tmp_path / "bad.ckpt"
        bad.write_bytes(content)
        with pytest.raises(CheckpointError, match=r"^ckpt_path=.* is invalid: .*the file is corrupted: ") as info:
            load_checkpoint(bad)
        text = str(info.value)
        assert "never executes code" not in text and "weights_only" not in text and "\n" not in text


# ------------------------------------------------------------------------------------------------ --config files
BAD_CONFIGS = {
    "empty.yaml": ("", "the file is empty"),
    "comments.yaml": ("# nothing here\n", "the file is empty (only comments)"),
    "list.yaml": ("[1, 2]\n", "the file holds a list: [1, 2]"),
    "string.yaml": ("just a string\n", "the file holds a string: just a string"),
    "null.yaml": ("null\n", "the file holds null"),
    "broken.yaml": ("trainer: [\n", "the file is not valid YAML (line 2, column 1"),
}
EXPECTED = "is invalid: expected a YAML mapping of sections (trainer:, model:, data:, ...)"


@pytest.mark.parametrize("name", list(BAD_CONFIGS))
@pytest.mark.parametrize("form", ["--config", "--config=", "-c"])
def test_a_bad_config_file_is_one_line_naming_it(name: str, form: str, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    text, what = BAD_CONFIGS[name]
    (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    args = [f"--config={name}"] if form == "--config=" else [form, name]
    assert cli.main(["fit", *args, "--trainer.num_rounds", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"error: --config={name!r} {EXPECTED}; {what}"), err
    assert "Unexpected config" not in err


def test_a_bad_config_named_without_suffix_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "mine.yaml").write_text("")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"^--config='mine' \(mine\.yaml\) is invalid: expected a YAML mapping"):
        shipped.rewrite_config_args(["fit", "--config", "mine"])


def test_a_bad_config_after_a_good_one_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "good.yaml").write_text("trainer:\n  num_rounds: 1\n")
    (tmp_path / "bad.yaml").write_text("[1, 2]\n")
    monkeypatch.chdir(tmp_path)
    args = ["fit", "--config", "good.yaml", "--config", "quickstart", "--trainer.num_rounds", "1"]
    assert shipped.rewrite_config_args(args)[:3] == ["fit", "--config", "good.yaml"]  # good files pass unchanged
    with pytest.raises(ConfigError, match=r"^--config='bad\.yaml' is invalid: .* the file holds a list"):
        shipped.rewrite_config_args(["fit", "--config", "good.yaml", "-c", "bad.yaml"])


def test_inline_yaml_and_every_shipped_config_pass_the_check(tmp_path: Path) -> None:
    args = ["fit", "--config", "{trainer: {num_rounds: 2}}"]
    assert shipped.rewrite_config_args(args, cwd=tmp_path) == args  # YAML content is jsonargparse's
    for name, path in shipped.shipped_configs().items():
        shipped.check_config_file(name, str(path))
