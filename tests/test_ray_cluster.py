"""A tiny federation on a local two-node Ray cluster (issue 13): two ``ray start`` processes on this machine, one
CPU each, and ``pl-fed fit --trainer.executor.address``. Two workers of one CPU each can only be placed one per
node, so the run uses both nodes; its metrics equal the in-process run's."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("ray")
RAY = shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray")
ROOT = Path(__file__).resolve().parents[1]
# Ray >= 2.5x enables token authentication by default; this throwaway local cluster opts out
# (docs/scaling.md: cluster recipe)
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def two_node_cluster(tmp_path: Path) -> Iterator[str]:
    if RAY is None:
        pytest.skip("the ray command is not installed")
    port = _free_port()
    address = f"127.0.0.1:{port}"
    logs = [(tmp_path / "head.log").open("w"), (tmp_path / "node.log").open("w")]
    procs = [subprocess.Popen([RAY, "start", "--head", f"--port={port}", "--num-cpus=1", "--include-dashboard=false",
                               "--block"], env=ENV, stdout=logs[0], stderr=subprocess.STDOUT)]
    try:
        time.sleep(3)
        procs.append(subprocess.Popen([RAY, "start", f"--address={address}", "--num-cpus=1", "--block"], env=ENV,
                                      stdout=logs[1], stderr=subprocess.STDOUT))
        deadline = time.time() + 90
        while time.time() < deadline:  # wait until both nodes are alive
            out = subprocess.run([RAY, "status", f"--address={address}"], env=ENV, capture_output=True, text=True, check=False)
            if out.returncode == 0 and out.stdout.count("node_") >= 2:
                break
            time.sleep(2)
        else:
            pytest.fail("the two-node Ray cluster did not come up:\n" + (tmp_path / "head.log").read_text()[-2000:])
        yield address
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
        for f in logs:
            f.close()


def _fit(run_dir: Path, *extra: str) -> list[dict]:
    cmd = [sys.executable, "-m", "pl_fedsparse.cli", "fit", "--config", "configs/quickstart.yaml",
           "--trainer.num_rounds", "2", "--trainer.default_root_dir", str(run_dir), *extra]
    res = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, check=False, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time")} for r in rows]


@pytest.mark.slow
def test_a_federation_on_a_two_node_cluster(tmp_path: Path, two_node_cluster: str) -> None:
    on_cluster = _fit(tmp_path / "cluster", "--trainer.executor", "pl_fedsparse.executors.RayExecutor",
                      "--trainer.executor.num_workers", "2", "--trainer.executor.address", two_node_cluster)
    assert on_cluster == _fit(tmp_path / "local")
