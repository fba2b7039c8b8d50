"""Notebooks run end to end on tiny settings (code cells executed in-process, no Jupyter kernel needed)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
@pytest.mark.slow
def test_notebook_runs(path: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")  # both notebooks draw figures (the [plots] extra; installed with [test])
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the notebooks' scratch folders: in the test's own
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


def test_notebooks_store_no_outputs() -> None:
    """A notebook's stored outputs are not checked against the records, so none are kept: what a notebook shows
    it computes when it runs."""
    for path in NOTEBOOKS:
        for i, cell in enumerate(c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"):
            assert cell.get("outputs") == [] and cell.get("execution_count") is None, f"{path.name}, code cell {i}"


def test_results_notebook_reads_the_records_the_fedpse_page_cites(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    """The results notebook's data cells, run on the committed records (no kernel, no training), print the FedPSE
    page's claims-table records: every run's final accuracy and the seeds' mean ± std, as the records give them."""
    import statistics

    root = NOTEBOOKS[0].parent.parent
    monkeypatch.chdir(root)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the setup cell's scratch folder (the clean-up cell
    # that removes it is not run here)
    monkeypatch.delenv("PL_FEDSPARSE_TINY", raising=False)
    path = root / "notebooks" / "results.ipynb"
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    namespace: dict = {"__name__": "__notebook__"}
    for i in (0, 1):  # the setup and the runs' table (the figures and the clean-up are the slow test's)
        exec(compile("".join(cells[i]["source"]), f"{path.name}[cell {i}]", "exec"), namespace)
    records = namespace["RECORDS"].relative_to(root).as_posix()
    page = (root / "papers" / "fedpse" / "README.md").read_text()
    assert f"dir: {records}\n" in page  # a checked table of the page reads the same folder
    dirs = sorted(p for p in (root / records).iterdir() if (p / "summary.json").exists())
    assert sorted(namespace["run_dirs"]) == dirs and len(dirs) >= 12
    table = namespace["markdown_table"](namespace["runs"])
    for d in dirs:
        acc = json.loads((d / "summary.json").read_text())["final"]["acc_mean"] * 100
        assert f"| {d.name} | " in table and f" | {acc:.2f} | " in table.split(f"| {d.name} | ")[1].split("\n")[0]
    seeds = namespace["seed_table"](namespace["runs"])[0]
    for group in ("fedavg_n10_lam1", "fedpse_n10_lam1", "fedavg_n10_lam0.5", "fedpse_n10_lam0.5"):
        accs = [json.loads((root / records / f"{group}_seed{s}" / "summary.json").read_text())["final"]["acc_mean"]
                * 100 for s in (0, 1, 2)]
        line = next(x for x in seeds.splitlines() if x.startswith(f"| {group}_seed0,"))
        assert f"| {statistics.mean(accs):.2f} ± {statistics.stdev(accs):.2f} (3) |" in line, line
