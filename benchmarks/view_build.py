"""What building a config's evaluation views costs: every client's loader of every view (shifted samples drawn,
images corrupted), as the evaluator builds them once per evaluation, without any forward pass.

The federation is set up from the config without training, at its last round (so views meant for the end are due).
Prints the CPU seconds of building every view of every client, and the views that cost most.

    OMP_NUM_THREADS=1 python benchmarks/view_build.py --config configs/cifar10_dmpfl_plus_cpu.yaml --data-root data/cifar10
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from eval_views import build  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "cifar10_dmpfl.yaml"))
    p.add_argument("--data-root", default=None, help="CIFAR-10 folder (default: the config's)")
    a = p.parse_args()
    logging.disable(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        loop = build(a.config, a.data_root, None, tmp)
        ev, views = loop.evaluator, loop.evaluator.views()
        per_view: dict[str, float] = {}
        start = time.process_time()
        for k in range(loop.num_clients):
            for v in views.values():
                t = time.process_time()
                ev.loader(k, "train" if v.split == "train" else loop.eval_split, v.shift, v.corruption, v.severity)
                per_view[v.name] = per_view.get(v.name, 0.0) + time.process_time() - t
        total = time.process_time() - start
        loop.reporter.release()
    print(f"config {Path(a.config).name}: {loop.num_clients} clients, {len(views)} views")
    print(f"building every view of every client: {total:.2f} s CPU")
    for name, sec in sorted(per_view.items(), key=lambda kv: -kv[1])[:5]:
        print(f"  {name}: {sec:.2f} s")


if __name__ == "__main__":
    main()
