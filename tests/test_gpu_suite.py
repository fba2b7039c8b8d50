"""``benchmarks/gpu_suite.sh --dry-run`` runs without a GPU: every step's command parses and every timed config
resolves (CI has no GPU; the real run happens whenever a GPU is lent)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _suite(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    return subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_suite.sh"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600, check=False)


def test_the_dry_run_resolves_every_step() -> None:
    res = _suite("--dry-run")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout
    for name in ("fedavg", "pfedgate", "fedspa_dst", "dispfl", "dmpfl", "fedpse"):
        assert f"{name}: " in out and "resolves" in out, out
    for step in ("pytest -q -p no:cacheprovider -m gpu", "overhead.py", "gpu_rounds.py run", "ray_speedup.py one",
                 "vectorized.py --task lenet --clients 100 --accelerator gpu", "vectorized.py parses"):
        assert step in out, (step, out)
    assert "dry run: every step's command resolves" in out


def test_a_bad_argument_is_one_line() -> None:
    res = _suite("--only", "nonsense")
    assert res.returncode == 2
    assert res.stderr.strip() == ("error: gpu_suite.sh: --only 'nonsense' is not a step "
                                  "(allowed: env tests overhead rounds ray vectorized)")
