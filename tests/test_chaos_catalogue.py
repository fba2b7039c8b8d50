"""The catalogue of ``benchmarks/chaos.py --catalogue``, in-process: every bad input over the user's code, data and
config ends in its one expected line with its exit status and nothing written before the refusal; every run directory
whose own entries are links leaves the files outside it untouched; no crafted checkpoint, ``run.json`` or
``config.yaml`` imports a module it names (``benchmarks/chaos_catalogue.py`` holds the cases and the judge)."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from chaos_catalogue import CASES, judge, run_in_process

pytestmark = pytest.mark.slow  # (about 200 runs of pl-fed: minutes)


def test_the_catalogue_has_the_cases_the_issue_asks_for() -> None:
    groups = Counter(c.group for c in CASES)
    assert groups["input"] >= 100 and groups["link"] >= 10 and groups["provenance"] >= 5, groups
    assert len({c.id for c in CASES}) == len(CASES)
    assert all(c.expect or c.code == 0 for c in CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_case(case, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    code, out, err, before = run_in_process(case, tmp_path)
    verdict = judge(case, tmp_path, code, out, err, before)
    assert not verdict["problems"], verdict["problems"]
