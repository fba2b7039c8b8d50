"""Notebooks run end to end on tiny settings (code cells executed in-process, no Jupyter kernel needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
@pytest.mark.slow
def test_notebook_runs(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")  # both notebooks draw figures (the [plots] extra; installed with [test])
    monkeypatch.setenv("PL_FEDSPARSE_TINY", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")  # no display in the test suite
    nb = json.loads(path.read_text())
    namespace: dict = {"__name__": "__notebook__"}
    for i, cell in enumerate(c for c in nb["cells"] if c["cell_type"] == "code"):
        source = "".join(cell["source"])
        exec(compile(source, f"{path.name}[cell {i}]", "exec"), namespace)
    if path.name == "tutorial.ipynb":
        assert namespace["results"]["local"]["comm_cum_bytes_total"] == 0
        assert len(namespace["ax"].lines) == len(namespace["results"])  # the figure: one curve per run
    elif path.name == "results.ipynb":
        assert len(namespace["runs"]) == 2 and "| fedpse |" in namespace["markdown_table"](namespace["runs"])
        assert [p.name for p in namespace["figures"]] == ["acc_vs_round.png", "acc_vs_traffic.png", "client_acc.png"]
