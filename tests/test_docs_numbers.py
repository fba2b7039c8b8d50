"""The numbers in the reproduction pages are the committed records' numbers.

Every markdown table in ``README.md``, ``docs/**/*.md``, ``papers/**/*.md`` (each paper's page and notes) and the
engine studies' pages (``benchmarks/*.md``, ``benchmarks/*/README.md``) that is preceded by a ``<!-- numbers ... -->``
comment is *checked*: the comment is a small YAML spec that says where each column's numbers come from, the checker
recomputes every cell from the records (``papers/<paper>/records/**``, ``benchmarks/**``: ``summary.json``,
``metrics.jsonl``, the ``*.json`` / ``*.txt`` records) and compares it with the page number by number: every number in
a cell must read exactly as the records' value printed with the spec's format (so at the page's precision). A stale or
hand-edited number fails, and so do a number in a column the spec does not map, a row the spec does not know and a
spec row missing from the table. The spec::

    <!-- numbers
    id: fedspa-200                       # the table's name in error messages
    dir: papers/fedspa/records/long_horizon   # records are named relative to this folder (default: the repository)
    key: run                              # the column(s) whose text names the row (their numbers are labels)
    let: {P: '"r.final.acc_mean*100"'}    # names for every row: Python expressions (row-level ``let`` too)
    rows:                                 # row label -> variables for the cell templates
      FedSpa-DST: {runs: fedspa_dst fedspa_dst_seed*}
      Local: {run: fedspa_local, let: {a: 'vals("fedspa_local", P)'}}
    vars: {clients: n}                    # or: variables read from the key columns' text (instead of ``rows``)
    cols:                                 # column header -> cell template ({expression:format} fields)
      personal acc %: '{seeds("r.final.acc_mean*100", 2)}'
      total MB: '{r.s.comm_cum_bytes_total/1e6:.1f}'
      verdict: {text: '{claim(...).verdict}'}   # compare the whole text, not only its numbers
      global: {Local: '-', '*': '{...}'}    # a template per row label ('*': the others)
    -->

Run names are relative to ``dir``; a name starting with ``/`` is relative to the repository. Names in the spec (rows,
columns) are matched as the table shows them, without ``**`` and backticks.

A cell template is text with ``{expression}`` or ``{expression:format}`` fields; the expression is Python, evaluated
with the row's variables and these names:

* ``r`` — the row's run (``run: NAME``), ``runs`` — its runs (``runs: NAME GLOB...``, records with a
  ``summary.json``); ``run(NAME)`` — any run. A run has ``.s`` (``summary.json``), ``.final`` (its ``final``),
  ``.after(n)`` (the ``metrics.jsonl`` row of 0-based round ``n - 1``), ``.last(key)`` / ``.best(key)`` /
  ``.best_row(key)`` (the last / highest recorded value, the row holding it), ``.rows``. JSON objects read as
  attributes (``r.final.acc_mean``) or items (``r.final["seen/acc_weighted"]``).
* ``seeds(expr, d)`` — ``mean ± sample std (n)`` of ``expr`` over ``runs`` (``mean (1)`` for one run), as
  ``pl-fed report``'s ``seeds.md`` prints it; ``vals(runs, expr)`` — the values (``runs``: names and globs);
  ``st(values, d)`` — those values as ``mean ± std (n)``; ``claim(a, b)`` — two value lists compared as ``pl-fed report``
  compares methods: runs on the same seeds pair by pair (the paired t-test), other groups by Welch's test;
  ``.gap``, ``.spread`` (the larger sample std), ``.ci_text`` (the 95 % interval of ``a − b``), ``.p_text``,
  ``.verdict`` ("holds" / "reversed" when the interval excludes 0, else "not shown", with the interval, p, the test
  and the number of seeds), ``.same_verdict`` (for ``a ≈ b``: "no difference shown" or "differs"); ``consensus(run)`` — a serverless run's
  consensus accuracy (its ``consensus_acc``, else ``consensus.json`` beside the record, else ``None``);
  ``known(values)`` — the values that are not ``None``.
* ``J(file)`` — a JSON record, ``find(list, key, suffix)`` — its item whose ``key`` ends with ``suffix``;
  ``T(file, regex, group)`` — a group of ``regex``'s first match in a text record, ``count(file, regex)`` — its
  number of matches; ``md(file, k)`` — the ``k``-th markdown table of a text record as ``{first cell: {header:
  cell}}``; ``bottom(values)`` — the ⌊N/10⌋-th smallest value.

* ``cfg(file, "a.b.c")`` — the value at a dotted key (an integer part indexes a list) of a committed YAML file: a
  config (``cfg("/configs/quickstart.yaml", "trainer.num_rounds")``) or a run's ``config.yaml``;
  ``default("pl_fedsparse.callbacks.Ditto", "lam")`` — a parameter's default (:func:`inspect.signature`);
  ``const("pl_fedsparse.run.stats.CONFIDENCE")`` — a module-level name of the package: a constant, or a function or
  class that the template calls (ERK's layer densities of a config's model: the code computes them, nothing copies
  them);
  ``paper(name, key)`` — a number quoted from a paper: ``papers/quoted.yaml`` holds, per paper (``pfedgate``,
  ``fedspa``, ``fedpse``, ``dmpfl``, ``dispfl``), its citation and its values, each ``{value, where}`` with the value
  as the paper prints it ("0.9334", "85.70±0.2") and where (table / figure / section). ``{paper(...)}`` writes that
  text; a format (``{paper(...):.1f}``) or arithmetic (``100*paper(...)``) reads its first number. A test checks
  that every quoted number occurs in the paper's text where the papers' text dumps are present.

No number may be written by the template itself: a number in a template's text (``'{len(r.rows)} / 500'``) or a
constant field (``'{500}'``) is an error, so that nothing is checked against itself.

**Prose.** A ``<!-- prose ... -->`` comment applies to the markdown block right after it (the paragraph or list item,
up to the next blank line, list item, heading, table, fence or HTML comment)::

    <!-- prose
    id: fedspa-gap                       # the block's name in error messages
    dir: papers/fedspa/records/long_horizon
    run: fedspa_dst                      # optional: r (or runs: NAME GLOB... for seeds(...))
    let: {A: 'vals("fedspa_dst fedspa_dst_seed*", "r.final.acc_mean*100")'}
    nums: ['{r.final.acc_mean*100:.1f}', '{st(A, 2)}', '{cfg("/configs/cifar10_fedspa_dst.yaml", "trainer.num_rounds")}']
    -->

The block's numbers are compared, in order, with the numbers of the rendered ``nums`` templates (same language and
names as the cells); a changed, missing or extra number is one error line (``page:line: prose 'id': number k reads X,
the records give Y``). ``--write`` does not rewrite prose.

Numbers in prose are read after dropping inline code spans, link targets (the text of a link is prose), URLs, HTML
comments and headings, and after **the label rule** — numbers that name rather than measure:

* references: ``Eq. 3``, ``Eqs. (3)-(4)``, ``§5.1``, ``Section 4``, ``Table 2``, ``Tab. 1``, ``Fig. 3``, ``App. C.1``,
  ``Algorithm 1 line 7``, ``Alg. 4``, ``Theorem``/``Lemma``/``Corollary``/``Proposition``/``Definition``/
  ``Assumption``/``Remark N``, ``Phase 1``, ``Step 2``; a range after any of them (``Eq. 3-4``), a list after a plural
  (``Tables 2 and 3``);
* names with a hyphen-joined number: ``CIFAR-10``, ``CIFAR-10-C``, ``ResNet-18``, ``top-1`` (digits glued to letters,
  ``VGG11``, ``ResNet18``, are never numbers);
* versions: ``v1.2``, three-part ``2.14.1``, ``Python``/``PyTorch``/``torch``/``CUDA``/``Lightning``/``Ray``/
  ``NumPy``/``SciPy``/``Ubuntu N``;
* dates and citations: ``2026-11-26``, a year before ``)`` (``(Li et al., 2023)``), after ``et al.`` or a venue
  (``ICML 2022``), arXiv ids and DOIs;
* a numbered list item's marker (``1.``) and footnote marks (``[2]``).

Everything else is a number that needs a source. **Coverage, with no opt-out:** on every page, a markdown table with a
number (after the label rule) and no numbers spec, a prose line with a number outside every prose-spec'd block, and a
spec'd table column with numbers that the spec does not map are errors naming page:line (a column quoted from a paper
reads ``paper(...)``). A table's key columns name its rows (their numbers are labels).

``python tests/test_docs_numbers.py --write PAGE...`` rewrites the checked cells of PAGE from the records (after new
seeds are recorded, for example); ``python tests/test_docs_numbers.py [PAGE...]`` checks the pages (all by default).
"""

from __future__ import annotations

import glob
import json
import math
import re
import statistics
import sys
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent


def _pages() -> list[str]:
    """Every page a user reads: the README, ``docs/``, each paper's folder and the engine studies' pages — not the
    text files inside records, nor anything under a git-ignored ``_runs/`` or ``.work/`` folder."""
    found = [*(REPO / "docs").rglob("*.md"), *(REPO / "papers").rglob("*.md"), *(REPO / "benchmarks").glob("*.md"),
             *(REPO / "benchmarks").glob("*/README.md")]
    rel = [p.relative_to(REPO) for p in found]
    return ["README.md"] + sorted(str(p) for p in rel
                                  if "records" not in p.parts and not any(s.startswith(("_", ".")) for s in p.parts))


#: every page a user reads: a table moved from one page to another stays checked
PAGES = _pages()

SPEC_RE = re.compile(r"^<!--\s*numbers\b(.*?)-->", re.DOTALL | re.MULTILINE)  # at a line start: not `<!-- numbers -->` quoted in prose
# a number: an optional sign, digits, decimals, an exponent — not part of a word ("conv2", "r34", "VGG11" are not
# numbers) and not a sign after a digit ("1.6-8.7" is 1.6 and 8.7)
NUMBER_RE = re.compile(r"(?<![\w.])[+\-−]?\d+(?:\.\d+)?(?:[eE][+\-]?\d+)?(?!\w|\.\d)")


# ------------------------------------------------------------------------------------------------ reading records
class Obj(dict):
    """A JSON object read by attribute (``o.final.acc_mean``) or item (``o["seen/acc_weighted"]``)."""

    def __getattr__(self, name: str):
        try:
            return wrap(self[name])
        except KeyError:
            raise AttributeError(f"no key {name!r} (keys: {', '.join(sorted(self))[:300]})") from None

    def __getitem__(self, name):
        return wrap(dict.__getitem__(self, name))


def wrap(v):
    if isinstance(v, dict) and not isinstance(v, Obj):
        return Obj(v)
    if isinstance(v, list):
        return [wrap(x) for x in v]
    return v


class Records:
    """Record files read once per checker run."""

    def __init__(self, root: Path):
        self.root = root
        self._cache: dict[tuple[str, Path], object] = {}  # by (how read, path): a file read as JSON and as text
        self._runs: dict[Path, Run] = {}

    def run(self, p: Path) -> Run:
        """The run at ``p``, one object per checker run (its parsed files and seeds read once)."""
        if p not in self._runs:
            self._runs[p] = Run(self, p)
        return self._runs[p]

    def path(self, base: Path, name: str) -> Path:
        p = (base / name) if not name.startswith("/") else (self.root / name.lstrip("/"))
        if not p.exists():
            raise LookupError(f"no record {p.relative_to(self.root) if p.is_relative_to(self.root) else p}")
        return p

    def _read(self, kind: str, p: Path, load):
        if (kind, p) not in self._cache:
            self._cache[(kind, p)] = load(p.read_text())
        return self._cache[(kind, p)]

    def json(self, p: Path):
        return wrap(self._read("json", p, json.loads))

    def jsonl(self, p: Path) -> list:
        return wrap(self._read("jsonl", p, lambda t: [json.loads(x) for x in t.splitlines() if x.strip()]))

    def yaml(self, p: Path):
        return self._read("yaml", p, yaml.safe_load)

    def text(self, p: Path) -> str:
        return self._read("text", p, str)


class Run:
    """One run's record: ``summary.json`` and ``metrics.jsonl``."""

    def __init__(self, records: Records, path: Path):
        self.records, self.path, self.name = records, path, path.name

    @cached_property
    def s(self) -> Obj:
        return self.records.json(self.path / "summary.json")

    @property
    def final(self) -> Obj:
        return self.s.final

    @cached_property
    def rows(self) -> list[Obj]:
        return self.records.jsonl(self.path / "metrics.jsonl")

    def after(self, n: int) -> Obj:
        """The row of round ``n - 1`` (0-based): the state after ``n`` rounds."""
        for row in self.rows:
            if row["round"] == n - 1:
                return row
        raise LookupError(f"{self.name}: no metrics row for round {n - 1}")

    def evaluated(self, key: str = "acc_mean") -> list[Obj]:
        return [row for row in self.rows if row.get(key) is not None]

    def last(self, key: str = "acc_mean"):
        """The last recorded value of ``key`` (``None`` if no row has it)."""
        rows = self.evaluated(key)
        return rows[-1][key] if rows else None

    def best(self, key: str = "acc_mean"):
        return max(row[key] for row in self.evaluated(key))

    def best_row(self, key: str = "acc_mean") -> Obj:
        return max(self.evaluated(key), key=lambda row: row[key])

    @cached_property
    def seed_key(self):
        """The run's seeds as ``pl-fed report`` pairs runs (``None`` when its config sets none)."""
        from pl_fedsparse.run.runs import _seed_key

        return _seed_key(self)

    def __repr__(self) -> str:
        return f"Run({self.name})"


def summary_mismatches(root: Path) -> list[str]:
    """One line per run record under ``root`` whose ``summary.json``'s ``final`` differs from the last row of its
    ``metrics.jsonl`` (naming the keys and both values)."""
    out = []
    for summary in sorted(root.glob("**/summary.json")):
        if ".venv" in summary.parts or "_runs" in summary.parts:
            continue
        metrics = summary.parent / "metrics.jsonl"
        rel = summary.relative_to(root)
        if not metrics.exists():
            continue  # a summary of something else (not a run record)
        final = json.loads(summary.read_text()).get("final")
        rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
        if final is None or not rows:
            out.append(f"{rel}: {'no final row' if final is None else 'metrics.jsonl is empty'}")
            continue
        last = rows[-1]
        same = lambda x, y: x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))  # noqa: E731
        diff = [k for k in sorted(set(final) | set(last)) if not same(final.get(k), last.get(k))]
        if diff:
            k = diff[0]
            out.append(f"{rel}: final[{k!r}] = {final.get(k)!r} but the last metrics.jsonl row has {last.get(k)!r}"
                       f"{f' (and {len(diff) - 1} more keys)' if len(diff) > 1 else ''}")
    return out


def _natural(p: Path):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)]


def resolve_runs(records: Records, base: Path, spec: str) -> list[Run]:
    runs: list[Run] = []
    for word in spec.split():
        if any(ch in word for ch in "*?["):
            # like records.path: a pattern starting with "/" is relative to the repository, not to ``dir``
            pattern = records.root / word.lstrip("/") if word.startswith("/") else base / word
            hits = sorted((Path(p) for p in glob.glob(str(pattern)) if (Path(p) / "summary.json").exists()),
                          key=_natural)
        else:
            hits = [records.path(base, word)]
        runs += [records.run(p) for p in hits if p not in [r.path for r in runs]]
    if not runs:
        raise LookupError(f"no records for runs {spec!r} under {base.relative_to(records.root)}")
    return runs


# ------------------------------------------------------------------------------------------------- statistics
def sample_std(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else math.nan


def seeds_text(values: list[float], d: int) -> str:
    """``mean ± sample std (n)``, ``mean (1)`` for one value — ``pl-fed report``'s ``seeds.md`` format."""
    m = statistics.fmean(values)
    if len(values) == 1:
        return f"{m:.{d}f} (1)"
    return f"{m:.{d}f} ± {sample_std(values):.{d}f} ({len(values)})"


class Values(list):
    """Values of an expression over runs, with each run's seeds (``pl-fed report``'s pairing key; ``None`` for a run
    whose config sets none): what lets :class:`Claim` pair two methods' runs seed by seed."""

    def __init__(self, values, seeds=None):
        super().__init__(values)
        self.seeds = list(seeds) if seeds is not None else [None] * len(self)


def _paired(a, b):
    """``(a, b)`` on the seeds they share, ``a[i]`` and ``b[i]`` of one seed — as ``pl-fed report`` pairs groups: at
    least two shared seeds (a side's runs on other seeds are left out of the paired test) — or ``None`` when the runs
    cannot be paired."""
    sa, sb = getattr(a, "seeds", None), getattr(b, "seeds", None)
    if not sa or not sb or None in sa or None in sb or len(set(sa)) != len(sa) or len(set(sb)) != len(sb):
        return None
    where = {k: i for i, k in enumerate(sb)}
    shared = [i for i, k in enumerate(sa) if k in where]
    if len(shared) < 2:
        return None
    return [a[i] for i in shared], [b[where[sa[i]]] for i in shared]


@dataclass
class Claim:
    """``a > b`` over seeds, read as a reviewer would (``pl-fed report``'s statistics,
    :mod:`pl_fedsparse.run.report`): runs on the same seeds are compared pair by pair — the mean of ``a − b`` per
    shared seed (at least two), its 95 % interval and the paired t-test's p; other groups by Welch's difference. The verdict is read from
    the interval: "holds" when it lies above 0, "reversed" when below, "not shown" when it holds 0 (and below two
    seeds a side, where there is no interval)."""

    a: list[float]
    b: list[float]
    d: int = 2

    @cached_property
    def stats(self) -> dict:
        from pl_fedsparse.run.stats import paired_difference, welch_difference

        pairs = _paired(self.a, self.b)
        out = paired_difference(*pairs) if pairs is not None else welch_difference(list(self.a), list(self.b))
        out["test"] = "paired" if pairs is not None else "Welch"
        return out

    @property
    def gap(self) -> float:
        """The difference of the means — over the shared seeds where the runs are paired (the paired test's gap)."""
        a, b = _paired(self.a, self.b) or (self.a, self.b)
        return statistics.fmean(a) - statistics.fmean(b)

    @property
    def spread(self) -> float:
        return max(sample_std(self.a), sample_std(self.b))

    @property
    def seeds(self) -> int:
        return min(len(self.a), len(self.b))

    @property
    def spread_text(self) -> str:
        return "-" if self.seeds < 2 else f"{self.spread:.{self.d}f}"

    @property
    def ci_text(self) -> str:
        s = self.stats
        if s["lo"] is None:
            return "-"
        return f"{s['lo']:+.{self.d}f} to {s['hi']:+.{self.d}f}"

    @property
    def p_text(self) -> str:
        p = self.stats["p"]
        return "-" if p is None else ("< 0.001" if p < 0.001 else f"{p:.3f}")

    @property
    def how(self) -> str:
        n = self.stats.get("n") or self.seeds
        return f"{self.stats['test']}, {n} seed{'s' if n != 1 else ''}"

    @property
    def verdict(self) -> str:
        """``holds`` / ``reversed`` / ``not shown``, with the interval, p and how many seeds."""
        s = self.stats
        if s["lo"] is None:
            return f"not shown ({'one seed' if self.seeds == 1 else self.how})"
        return f"{s['verdict']} (95 % CI {self.ci_text}, p {self.p_text}; {self.how})"

    @property
    def same_verdict(self) -> str:
        """For ``a ≈ b``: "no difference shown" where the interval holds 0, else how they differ."""
        s = self.stats
        if s["lo"] is None:
            return f"not shown ({'one seed' if self.seeds == 1 else self.how})"
        word = "no difference shown" if s["verdict"] == "not shown" else "differs"
        return f"{word} (95 % CI {self.ci_text}, p {self.p_text}; {self.how})"


def bottom(values: list[float]) -> float:
    """pFedGate/FedEM's bottom decile: the ⌊N/10⌋-th smallest value (0-based)."""
    return sorted(values)[len(values) // 10]


# ------------------------------------------------------------------------------------------------- templates
def _fields(template: str) -> list[str | tuple[str, str]]:
    """Split a template into literal text and (expression, format) fields."""
    out: list[str | tuple[str, str]] = []
    i, lit = 0, ""
    while i < len(template):
        ch = template[i]
        if ch == "{" and template.startswith("{{", i):
            lit, i = lit + "{", i + 2
            continue
        if ch == "}" and template.startswith("}}", i):
            lit, i = lit + "}", i + 2
            continue
        if ch != "{":
            lit, i = lit + ch, i + 1
            continue
        depth, j, quote, colon = 0, i + 1, None, -1
        while j < len(template):
            c = template[j]
            if quote:
                if c == quote:
                    quote = None
            elif c in "'\"":
                quote = c
            elif c in "([{":
                depth += 1
            elif c in ")]":
                depth -= 1
            elif c == "}":
                if depth == 0:
                    break
                depth -= 1
            elif c == ":" and depth == 0:
                colon = j
            j += 1
        else:
            raise ValueError(f"unclosed field in template {template!r}")
        body = template[i + 1:j]
        expr, fmt = (body, "") if colon < 0 else (template[i + 1:colon], template[colon + 1:j])
        if lit:
            out.append(lit)
            lit = ""
        out.append((expr.strip(), fmt))
        i = j + 1
    if lit:
        out.append(lit)
    return out


def render(template: str, ns: dict) -> str:
    parts = []
    for part in _fields(template):
        if isinstance(part, str):
            parts.append(part)
            continue
        expr, fmt = part
        value = eval(expr, {**ns, "__builtins__": _BUILTINS})
        parts.append("-" if value is None else format(value, fmt) if fmt else str(value))
    return "".join(parts)


_BUILTINS = {n: getattr(__builtins__, n) if not isinstance(__builtins__, dict) else __builtins__[n]
             for n in ("abs", "len", "max", "min", "round", "sum", "sorted", "float", "int", "str", "range", "format",
                       "enumerate", "zip", "any", "all", "list", "dict", "set", "bool")}


# ------------------------------------------------------------------------------------------------- markdown
def strip_md(cell: str) -> str:
    return re.sub(r"\s+", " ", cell.replace("**", "").replace("`", "")).strip()


def numbers(text: str) -> list[str]:
    return [n.replace("−", "-") for n in NUMBER_RE.findall(strip_md(text))]


_REF = r"\(?[A-Z]?\d+(?:\.\d+)*[a-z]?\)?"
#: the label rule: numbers that name something rather than measure it (see the module docstring, "Prose")
LABEL_RES = [
    # references into a paper or a page: Eq. 3, Eqs. (3)-(4), §5.1, Table 2, Tab. 1, Fig. 3, App. C.1,
    # Algorithm 1 line 7, Alg. 4, Theorem 2, Phase 1, Step 2; a range (Eq. 3-4); a list after a plural
    # (Tables 2 and 3, Eqs. 3, 4 and 5, §§3-4)
    re.compile(r"(?:\b(?:Tables|Eqs\.|Equations|Figs\.|Figures|Sections|Appendices|Algorithms|Theorems|Lemmas|[Ll]ines|"
               r"Phases|Steps)|§§)\s*" + _REF + r"(?:\s*(?:[–\-,&]|,? and|to)\s*" + _REF + r")*"),
    re.compile(r"(?:\b(?:Eq\.|Equation|Section|Sec\.|Table|Tab\.|Fig\.|Figure|App\.|Appendix|Algorithm|Alg\.|"
               r"Theorem|Lemma|Corollary|Proposition|Definition|Assumption|Remark|[Ll]ine|Phase|Step)|§)\s*"
               + _REF + r"(?:\s*[–\-]\s*" + _REF + r")?"),
    # names with a number joined by a hyphen: CIFAR-10, CIFAR-10-C, ResNet-18, top-1
    re.compile(r"\b[A-Za-z]+-\d+(?:-[A-Za-z]+)?\b"),
    # versions: v1.2, 2.14.1, Python 3.11, torch 2.14, CUDA 12
    re.compile(r"\bv\d+(?:\.\d+)+\b|\b\d+\.\d+\.\d+(?:\.\d+)*\b|"
               r"\b(?:Python|PyTorch|torch|CUDA|Lightning|lightning|Ray|NumPy|numpy|SciPy|scipy|Ubuntu)\s+\d+(?:\.\d+)*"),
    # dates and citations: 2026-11-26, (Li et al., 2023), ICML 2022, arXiv:2301.12345
    re.compile(r"\b\d{4}-\d{2}-\d{2}\b|\barXiv:?\s*\d{4}\.\d{4,5}(?:v\d+)?|\bdoi:?\s*10\.\d+/\S+|"
               r"(?:et al\.?,?|NeurIPS|ICML|ICLR|AAAI|KDD|CVPR|ICCV|ECCV|IJCAI|arXiv|TPAMI|TMLR|AISTATS|MLSys|UAI)\s*'?"
               r"(?:19|20)\d{2}[a-z]?\b|\b(?:19|20)\d{2}[a-z]?(?=\))"),
    # a numbered list item's marker and a footnote mark: "1. ", "[2]", "[^3]"
    re.compile(r"^\s*\d+[.)]\s", re.MULTILINE),
    re.compile(r"\[\^?\d+\]"),
]


def _blank(m: re.Match) -> str:
    return re.sub(r"[^\n]", " ", m.group(0))


def prose_text(text: str) -> str:
    """``text`` with what never holds a value blanked out (the same length, line breaks kept): HTML comments, inline
    code spans, link targets, URLs, bold marks, and the labels of :data:`LABEL_RES`."""
    text = re.sub(r"<!--.*?-->", _blank, text, flags=re.DOTALL)
    text = re.sub(r"(`+)(?:(?!\1).)+?\1", _blank, text)
    text = re.sub(r"(?<=\])\([^)\s]*\)", _blank, text)
    text = re.sub(r"<?https?://[^\s>)]+>?", _blank, text)
    text = text.replace("**", "  ")
    for rx in LABEL_RES:
        text = rx.sub(_blank, text)
    return text


def prose_positions(text: str) -> list[tuple[int, str]]:
    """``(offset, number)`` of each number of ``text`` that needs a source (see :func:`prose_text`)."""
    return [(m.start(), m.group(0).replace("−", "-")) for m in NUMBER_RE.finditer(prose_text(text))]


def prose_numbers(text: str) -> list[str]:
    """The numbers of a prose block (or a cell) that need a source."""
    return [n for _, n in prose_positions(text)]


def split_row(line: str) -> list[str]:
    cells = re.split(r"(?<!\\)\|", line.strip())
    return [c.strip() for c in cells[1:-1]]


@dataclass
class Table:
    spec: dict
    spec_line: int
    header: list[str]
    rows: list[tuple[int, list[str]]]  # (0-based line number, cells)
    lines: list[str] = field(default_factory=list)
    header_line: int = -1  # 0-based


def _line_offsets(lines: list[str]) -> list[int]:
    """The character offset at which each line starts (and one past the last)."""
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line) + 1)
    return offsets


def _line_of(offsets: list[int], pos: int) -> int:
    """The 0-based line holding character ``pos``."""
    return next(i for i, o in enumerate(offsets) if o > pos) - 1


def find_tables(text: str, page: str) -> tuple[list[Table], list[str]]:
    """Every ``<!-- numbers -->`` spec and the table right after it."""
    lines = text.splitlines()
    offsets = _line_offsets(lines)
    tables, errors = [], []
    for m in SPEC_RE.finditer(text):
        first = _line_of(offsets, m.start())
        try:
            spec = yaml.safe_load(m.group(1)) or {}
        except yaml.YAMLError as exc:
            errors.append(f"{page}:{first + 1}: the numbers spec is not YAML: {exc}")
            continue
        if not isinstance(spec, dict):
            errors.append(f"{page}:{first + 1}: the numbers spec is {type(spec).__name__} {str(spec)[:40]!r}: expected "
                          "a mapping (id, dir, rows, cols)")
            continue
        end = next(i for i, o in enumerate(offsets) if o > m.end() - 1) - 1
        i = end + 1
        while i < len(lines) and not lines[i].strip():
            i += 1
        if i + 1 >= len(lines) or not lines[i].lstrip().startswith("|") or "---" not in lines[i + 1]:
            errors.append(f"{page}:{first + 1}: numbers spec {spec.get('id')!r} is not followed by a table")
            continue
        header = [strip_md(c) for c in split_row(lines[i])]
        rows = []
        j = i + 2
        while j < len(lines) and lines[j].lstrip().startswith("|"):
            rows.append((j, split_row(lines[j])))
            j += 1
        tables.append(Table(spec, first, header, rows, lines, i))
    return tables, errors


# ------------------------------------------------------------------------------------------------- checking
@dataclass
class Result:
    errors: list[str] = field(default_factory=list)
    checked: int = 0
    tables: list[str] = field(default_factory=list)
    rewritten: dict[int, str] = field(default_factory=dict)


def _namespace(records: Records, base: Path, row_vars: dict) -> dict:
    def run(name: str) -> Run:
        return records.run(records.path(base, name))

    def runs_of(spec: str) -> list[Run]:
        return resolve_runs(records, base, spec)

    ns: dict = dict(row_vars)
    runs: list[Run] = []
    if "runs" in row_vars:
        runs = runs_of(str(row_vars["runs"]))
    elif "run" in row_vars:
        runs = [run(str(row_vars["run"]))]
    ns["runs"] = runs
    if len(runs) == 1:
        ns["r"] = runs[0]

    def vals(spec, expr: str) -> Values:
        group = runs_of(spec) if isinstance(spec, str) else spec
        return Values([eval(expr, {**ns, "r": x, "__builtins__": _BUILTINS}) for x in group],
                      [x.seed_key for x in group])

    def seeds(expr: str, d: int = 2, spec=None) -> str:
        """Over the runs that have a value (``None``: not recorded for that seed)."""
        values = [v for v in vals(runs if spec is None else spec, expr) if v is not None]
        return "-" if not values else seeds_text(values, d)

    def consensus(r: Run):
        """A serverless run's consensus accuracy: its ``consensus_acc`` (``Gossip(consensus_eval: true)``), else the
        ``consensus.json`` beside its record (``papers/dispfl/consensus_eval.py`` on its checkpoint), else ``None``."""
        if r.final.get("consensus_acc") is not None:
            return r.final["consensus_acc"]
        path = r.path.parent / "consensus.json"
        if path.exists():
            for item in records.json(path):
                if str(item["run_dir"]).endswith("/" + r.name):
                    return item["consensus_acc"]
        return None

    def known(values: list) -> Values:
        seeds = getattr(values, "seeds", [None] * len(values))
        return Values([v for v in values if v is not None], [k for v, k in zip(values, seeds) if v is not None])

    def J(name: str):
        return records.json(records.path(base, name))

    def T(name: str, regex: str, group: int = 1) -> str:
        m = re.search(regex, records.text(records.path(base, name)), flags=re.MULTILINE)
        if m is None:
            raise LookupError(f"{name}: no match for {regex!r}")
        return m.group(group)

    def count(name: str, regex: str) -> int:
        return len(re.findall(regex, records.text(records.path(base, name)), flags=re.MULTILINE))

    def md(name: str, k: int = 0) -> dict:
        tabs, cur = [], None
        for line in records.text(records.path(base, name)).splitlines():
            if line.lstrip().startswith("|"):
                if cur is None:
                    cur = [split_row(line)]
                elif "---" not in line:
                    cur.append(split_row(line))
            elif cur is not None:
                tabs.append(cur)
                cur = None
        if cur is not None:
            tabs.append(cur)
        head, *body = tabs[k]
        return {r[0]: dict(zip(head, r)) for r in body}

    def find(items: list, key: str, suffix: str):
        for item in items:
            if str(item[key]).endswith(suffix):
                return item
        raise LookupError(f"no item with {key} ending in {suffix!r}")

    def cfg(name: str, key: str):
        """The value at the dotted ``key`` (``trainer.num_rounds``; an integer part indexes a list) of a committed
        YAML file: a config under ``configs/`` or a run's ``config.yaml``."""
        value = records.yaml(records.path(base, name))
        for part in key.split("."):
            try:
                value = value[int(part)] if isinstance(value, list) else value[part]
            except (KeyError, IndexError, ValueError, TypeError):
                raise LookupError(f"{name}: no key {key!r} (stopped at {part!r})") from None
        return value

    ns.update(run=run, vals=vals, seeds=seeds, st=seeds_text, claim=Claim, consensus=consensus, known=known,
              J=J, T=T, count=count, md=md, find=find, bottom=bottom, mean=statistics.fmean, std=sample_std,
              cfg=cfg, default=default, const=const, paper=lambda name, key: quoted_value(records.root, name, key))
    return ns


def default(qualname: str, param: str):
    """The default of the parameter ``param`` of ``qualname`` (a class's constructor or a function of this
    package, ``pl_fedsparse.callbacks.Ditto``), read with :func:`inspect.signature`."""
    import importlib
    import inspect

    parts = qualname.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        break
    else:
        raise LookupError(f"cannot import {qualname!r}")
    params = inspect.signature(obj).parameters
    if param not in params or params[param].default is inspect.Parameter.empty:
        raise LookupError(f"{qualname} has no parameter {param!r} with a default")
    return params[param].default


def const(qualname: str):
    """A module-level constant of this package (``pl_fedsparse.run.stats.CONFIDENCE``)."""
    import importlib

    module, _, name = qualname.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        raise LookupError(f"no constant {qualname!r}") from None


#: the numbers quoted from the papers, with their source (``papers/quoted.yaml``)
QUOTED = "papers/quoted.yaml"


def quoted(root: Path = REPO) -> dict:
    """``papers/quoted.yaml``: per paper its citation and its quoted values (``{key: {value, where}}``); parsed once
    per version of the file."""
    path = root / QUOTED
    if not path.exists():
        return {}
    st = path.stat()
    key = (path, st.st_mtime_ns, st.st_size)
    if key not in _QUOTED_CACHE:
        _QUOTED_CACHE.clear()
        _QUOTED_CACHE[key] = yaml.load(path.read_text(), Loader=_UniqueKeys)  # noqa: S506 (a SafeLoader)
    return _QUOTED_CACHE[key]


_QUOTED_CACHE: dict[tuple[Path, int, int], dict] = {}


class _UniqueKeys(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (plain YAML keeps the last one silently: a
    value quoted twice under one name would hide the first)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"{QUOTED}: {key!r} is given twice",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


class Quoted(str):
    """A number quoted from a paper, as the paper prints it: ``{paper(...)}`` writes that text ("0.9334",
    "88.2±0.4"); a format (``{paper(...):.1f}``) or arithmetic (``100 * paper(...)``) reads its first number."""

    def __float__(self) -> float:
        return float(numbers(self)[0])

    def __format__(self, spec: str) -> str:
        return str(self) if not spec else format(float(self), spec)

    def __mul__(self, other):
        return float(self) * other

    __rmul__ = __mul__

    def __add__(self, other):
        return float(self) + other

    def __radd__(self, other):
        return other + float(self)

    def __sub__(self, other):
        return float(self) - other

    def __rsub__(self, other):
        return other - float(self)

    def __truediv__(self, other):
        return float(self) / other


def quoted_value(root: Path, name: str, key: str) -> Quoted:
    """The value ``key`` quoted from paper ``name``, as the paper prints it."""
    data = quoted(root)
    if name not in data:
        raise LookupError(f"{QUOTED} has no paper {name!r} (papers: {', '.join(sorted(data))})")
    values = data[name].get("values") or {}
    if key not in values:
        raise LookupError(f"{QUOTED}: paper {name!r} has no value {key!r}")
    entry = values[key]
    return Quoted(entry["value"] if isinstance(entry, dict) else entry)


def check_table(table: Table, page: str, records: Records, result: Result) -> None:
    spec = table.spec
    tid = spec.get("id", f"line {table.spec_line + 1}")
    where = f"{page}, table {tid!r}"
    base = records.root / spec.get("dir", ".")
    key = spec.get("key", table.header[0])
    keys = [strip_md(str(k)) for k in ([key] if isinstance(key, str) else key)]
    # names in the spec are compared as the table shows them (without `code` and **bold** marks)
    cols = {strip_md(str(k)): ({strip_md(str(a)): b for a, b in v.items()} if isinstance(v, dict) and set(v) != {"text"}
                               else v) for k, v in (spec.get("cols") or {}).items()}
    if "skip" in spec:
        result.errors.append(f"{where}: 'skip:' is not allowed (every column is checked: a paper's column reads "
                             "paper(...))")
    for name in keys + list(cols):
        if name not in table.header:
            result.errors.append(f"{where}: the spec names column {name!r}, the table has {table.header}")
    if any(e.startswith(where) for e in result.errors):
        return
    rows_spec = spec.get("rows")
    if rows_spec is not None:
        rows_spec = {strip_md(str(k)): v for k, v in rows_spec.items()}
    vars_spec = {strip_md(str(k)): v for k, v in (spec.get("vars") or {}).items()}
    seen = set()
    literal_seen: set[tuple[str, str]] = set()
    result.tables.append(f"{page}: {tid}")
    for line_no, cells in table.rows:
        if len(cells) != len(table.header):
            result.errors.append(f"{where}, line {line_no + 1}: {len(cells)} cells for {len(table.header)} columns")
            continue
        by_col = dict(zip(table.header, cells))
        label = " | ".join(strip_md(by_col[k]) for k in keys)
        if rows_spec is not None:
            if label not in rows_spec:
                result.errors.append(f"{where}: row {label!r} has no entry in the spec's rows")
                continue
            row_vars = rows_spec[label]
            row_vars = {"run": row_vars} if isinstance(row_vars, str) else dict(row_vars or {})
        else:
            row_vars = {}
        for col, var in vars_spec.items():
            row_vars[var] = strip_md(by_col[col])
        seen.add(label)
        lets = {**(spec.get("let") or {}), **(row_vars.pop("let", None) or {})}
        try:
            ns = _namespace(records, base, row_vars)
            for name, expr in lets.items():
                ns[name] = eval(str(expr), {**ns, "__builtins__": _BUILTINS})
        except Exception as exc:  # noqa: BLE001 — a row whose records are missing or whose spec is wrong
            result.errors.append(f"{where}, row {label!r}: cannot read its records: {type(exc).__name__}: {exc}")
            continue
        new_cells = list(cells)
        for ci, col in enumerate(table.header):
            page_cell = cells[ci]
            if col in keys:
                continue
            if col not in cols:
                if prose_numbers(page_cell):
                    result.errors.append(f"{where}, row {label!r}, column {col!r}: the number(s) "
                                         f"{', '.join(prose_numbers(page_cell))} come from no record (unmapped column)")
                continue
            cspec = cols[col]
            text_mode = isinstance(cspec, dict) and set(cspec) == {"text"}
            template = cspec["text"] if text_mode else cspec
            if isinstance(template, dict):  # per-row templates: {row label: template, ...}
                template = {strip_md(str(k)): v for k, v in template.items()}
                template = template.get(label, template.get("*"))
                if template is None:
                    if prose_numbers(page_cell):
                        result.errors.append(f"{where}, row {label!r}, column {col!r}: unmapped number(s)")
                    continue
            lit = literal_numbers(template)
            if lit:
                if (col, str(template)) not in literal_seen:
                    literal_seen.add((col, str(template)))
                    result.errors.append(f"{where}, column {col!r}: the template {template!r} writes "
                                         f"{', '.join(lit)} itself (take each number from a field: a record, cfg(), "
                                         "default() or paper())")
                continue
            try:
                want = render(str(template), ns)
            except Exception as exc:  # noqa: BLE001 — reported as a failure of this cell
                result.errors.append(f"{where}, row {label!r}, column {col!r}: cannot compute from the records: "
                                     f"{type(exc).__name__}: {exc}")
                continue
            bold = page_cell.startswith("**") and page_cell.endswith("**") and len(page_cell) > 4
            new_cells[ci] = f"**{want}**" if bold else want
            cell_where = f"{where}, row {label!r}, column {col!r}"
            if text_mode:
                result.checked += len(numbers(want)) or 1
                if strip_md(page_cell) != strip_md(want):
                    result.errors.append(f"{cell_where}: page says {strip_md(page_cell)!r}, "
                                         f"the records give {strip_md(want)!r}")
                continue
            got, exp = numbers(page_cell), numbers(want)
            if len(got) != len(exp):
                result.errors.append(f"{cell_where}: page says {strip_md(page_cell)!r} ({len(got)} numbers), "
                                     f"the records give {want!r} ({len(exp)} numbers)")
                continue
            for g, e in zip(got, exp):
                result.checked += 1
                if g.lstrip("+") != e.lstrip("+") or (g.startswith("-") != e.startswith("-")):
                    result.errors.append(f"{cell_where}: page says {g}, the records give {e} "
                                         f"(cell {strip_md(page_cell)!r}, records {want!r})")
        if new_cells != cells:
            result.rewritten[line_no] = "| " + " | ".join(new_cells) + " |"
    if rows_spec is not None:
        for label in rows_spec:
            if label not in seen:
                result.errors.append(f"{where}: the spec's row {label!r} is not in the table")


def literal_numbers(template: str) -> list[str]:
    """The numbers a template writes itself — in its text or as a constant field (``{95}``): a number must come from
    a field that reads a source, or it would be checked against itself."""
    import ast

    out = []
    for part in _fields(str(template)):
        if isinstance(part, str):
            out += numbers(part)
            continue
        try:
            tree = ast.parse(part[0], mode="eval")
        except SyntaxError:
            continue
        if not any(isinstance(n, (ast.Name, ast.Call, ast.Attribute)) for n in ast.walk(tree)):
            out.append(part[0])
    return out


PROSE_RE = re.compile(r"^<!--\s*prose\b(.*?)-->", re.DOTALL | re.MULTILINE)
_ITEM_RE = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s")


def _block_end(lines: list[str], i: int) -> int:
    """The end (exclusive) of the markdown block starting at line ``i``: the paragraph or list item up to the next
    blank line, list item, heading, table, fence or HTML comment."""
    j = i + 1
    while j < len(lines):
        line = lines[j]
        if (not line.strip() or _ITEM_RE.match(line) or line.lstrip().startswith(("#", "|", "```", "<!--"))):
            break
        j += 1
    return j


@dataclass
class Prose:
    spec: dict
    spec_line: int  # 0-based
    first: int  # the block's lines: first (0-based) to end (exclusive)
    end: int
    text: str




def find_prose(text: str, page: str) -> tuple[list[Prose], list[str]]:
    """Every ``<!-- prose -->`` spec and the block right after it."""
    lines = text.splitlines()
    offsets = _line_offsets(lines)
    out, errors = [], []
    for m in PROSE_RE.finditer(text):
        first = _line_of(offsets, m.start())
        try:
            spec = yaml.safe_load(m.group(1)) or {}
        except yaml.YAMLError as exc:
            errors.append(f"{page}:{first + 1}: the prose spec is not YAML: {exc}")
            continue
        if not isinstance(spec, dict) or not isinstance(spec.get("nums"), list):
            errors.append(f"{page}:{first + 1}: the prose spec must be a mapping with id and nums (a list of "
                          f"templates), not {str(spec)[:60]!r}")
            continue
        i = _line_of(offsets, m.end() - 1) + 1
        while i < len(lines) and not lines[i].strip():
            i += 1
        if i >= len(lines) or lines[i].lstrip().startswith(("#", "|", "```", "<!--")):
            errors.append(f"{page}:{first + 1}: prose spec {spec.get('id')!r} is not followed by a paragraph or "
                          "list item")
            continue
        end = _block_end(lines, i)
        out.append(Prose(spec, first, i, end, "\n".join(lines[i:end])))
    return out, errors


def check_prose(prose: Prose, page: str, records: Records, result: Result) -> None:
    """Compare the numbers of a prose block, in order, with its spec's rendered ``nums``."""
    spec = prose.spec
    where = f"{page}:{prose.first + 1}: prose {spec.get('id', f'line {prose.spec_line + 1}')!r}"
    result.tables.append(f"{page}: prose {spec.get('id')}")
    row_vars = {k: spec[k] for k in ("run", "runs") if k in spec}
    base = records.root / spec.get("dir", ".")
    want: list[str] = []
    try:
        ns = _namespace(records, base, row_vars)
        for name, expr in (spec.get("let") or {}).items():
            ns[name] = eval(str(expr), {**ns, "__builtins__": _BUILTINS})
        for k, template in enumerate(spec["nums"]):
            lit = literal_numbers(template)
            if lit:
                result.errors.append(f"{where}: template {k + 1} {template!r} writes {', '.join(lit)} itself "
                                     "(take each number from a field: a record, cfg(), default() or paper())")
                return
            want += numbers(render(str(template), ns))
    except Exception as exc:  # noqa: BLE001 — a block whose records are missing or whose spec is wrong
        result.errors.append(f"{where}: cannot compute from the records: {type(exc).__name__}: {exc}")
        return
    got = prose_positions(prose.text)
    line = lambda k: prose.first + 1 + prose.text.count("\n", 0, got[k][0])  # noqa: E731
    result.checked += min(len(got), len(want))
    if len(got) != len(want):
        k = next((k for k, (g, w) in enumerate(zip(got, want)) if g[1] != w), min(len(got), len(want)))
        reads = f"reads {got[k][1]} (line {line(k)})" if k < len(got) else "is missing"
        gives = f"the records give {want[k]}" if k < len(want) else "the spec gives none"
        result.errors.append(f"{where}: number {k + 1} {reads}, {gives} (the block has {len(got)} numbers, the spec "
                             f"{len(want)})")
        return
    for k, ((_, g), w) in enumerate(zip(got, want)):
        if g.lstrip("+") != w.lstrip("+"):
            result.errors.append(f"{page}:{line(k)}: prose {spec.get('id')!r}: number {k + 1} reads {g}, "
                                 f"the records give {w}")


def _markdown_tables(lines: list[str]) -> list[tuple[int, int]]:
    """``(header line, end)`` of every markdown table (0-based, end exclusive)."""
    out, i = [], 0
    while i + 1 < len(lines):
        if lines[i].lstrip().startswith("|") and re.match(r"^\s*\|?\s*:?-{3,}", lines[i + 1]):
            j = i + 2
            while j < len(lines) and lines[j].lstrip().startswith("|"):
                j += 1
            out.append((i, j))
            i = j
        else:
            i += 1
    return out


def coverage_errors(text: str, page: str, tables: list[Table], proses: list[Prose]) -> list[str]:
    """One line per markdown table with a number but no numbers spec, and per prose line with a number that no
    prose spec covers: outside code fences, HTML comments, tables and headings."""
    lines = text.splitlines()
    errors = []
    specced = {t.header_line for t in tables}
    blocked = set()
    for head, end in _markdown_tables(lines):
        blocked.update(range(head, end))
        if head in specced:
            continue
        found = [n for line in lines[head + 2:end] for c in split_row(line) for n in prose_numbers(c)]
        if found:
            errors.append(f"{page}:{head + 1}: a table with numbers ({', '.join(found[:4])}"
                          f"{', ...' if len(found) > 4 else ''}) has no <!-- numbers --> spec")
    for p in proses:
        blocked.update(range(p.first, p.end))
    fence = False
    blank = prose_text(text).splitlines()  # comments and labels blanked, lines kept
    for i, line in enumerate(lines):
        if line.lstrip().startswith(("```", "~~~")):
            fence = not fence
            continue
        if fence or i in blocked or line.lstrip().startswith("#") or i >= len(blank):
            continue
        found = [m.group(0) for m in NUMBER_RE.finditer(blank[i])]
        if found:
            errors.append(f"{page}:{i + 1}: the number(s) {', '.join(found[:4])} in prose come from no "
                          "<!-- prose --> spec")
    return errors


def check_text(text: str, page: str, root: Path = REPO) -> Result:
    """Check every table of ``text`` (the page ``page``) that has a numbers spec and every prose block that has a
    prose spec against the records under ``root``, and that no table or prose number goes without a spec."""
    records = Records(root)
    result = Result()
    tables, errors = find_tables(text, page)
    proses, prose_errors = find_prose(text, page)
    result.errors += errors + prose_errors
    for table in tables:
        check_table(table, page, records, result)
    for prose in proses:
        check_prose(prose, page, records, result)
    result.errors += coverage_errors(text, page, tables, proses)
    return result


def rewrite(text: str, page: str, root: Path = REPO) -> tuple[str, Result]:
    """``text`` with every checked cell recomputed from the records (cells that cannot be computed are kept)."""
    result = check_text(text, page, root)
    lines = text.splitlines()
    for line_no, line in result.rewritten.items():
        lines[line_no] = line
    return "\n".join(lines) + ("\n" if text.endswith("\n") else ""), result


# ------------------------------------------------------------------------------------------------- the tests
def _page(name: str) -> str:
    return (REPO / name).read_text()


def test_every_checked_table_matches_its_records():
    errors, total = [], 0
    for page in PAGES:
        result = check_text(_page(page), page)
        errors += result.errors
        total += result.checked
    assert not errors, f"{len(errors)} number(s) differ from the committed records (regenerate with " \
                       f"`python tests/test_docs_numbers.py --write PAGE`, or fix the spec):\n" + "\n".join(errors)
    assert total > 500


#: the tables that must stay checked (a page that drops its spec would otherwise pass silently)
REQUIRED = {
    "papers/fedspa/README.md": {"fedspa-200", "fedspa-claims", "fedspa-trajectory", "fedspa-backbone"},
    "papers/dispfl/README.md": {"dispfl-200", "dispfl-claims", "dispfl-trajectory", "dispfl-why"},
    "papers/pfedgate/README.md": {"pfedgate-t1", "pfedgate-t8", "pfedgate-long", "pfedgate-plateau",
                                  "pfedgate-cost", "pfedgate-seeds", "pfedgate-claims"},
    "papers/fedpse/README.md": {"fedpse-sweep", "fedpse-t1", "fedpse-t2", "fedpse-ablation", "fedpse-bytes",
                                "fedpse-round1", "fedpse-first-look", "fedpse-claims-seeds", "fedpse-long-claims"},
    "papers/dmpfl/README.md": {"dmpfl-alpha", "dmpfl-recorded", "dmpfl-table", "dmpfl-claims", "dmpfl-shift-why",
                               "dmpfl-table-r100", "dmpfl-claims-r100", "dmpfl-shift-why-r100",
                               "dmpfl-alpha-synthetic", "dmpfl-iterations", "dmpfl-iterations-claims"},
    "benchmarks/ENGINE.md": {"chaos-kill", "chaos-all", "chaos-term-after-fix", "overhead-cpu",
                             "overhead-whole-round", "fit-runner", "vectorized-engine", "vectorized-gpu",
                             "client-memory", "flush-denormal"},
    "papers/fedpse/baselines.md": {"fedpse-protocol", "fedpse-protocol-seeds"},
    # the README's results live on the pages above (each paper's claims and tables, the engine's measurements);
    # the README keeps the quickstart's numbers and one checked line per paper
    "README.md": {"readme-quickstart", "readme-claims"},
}


def test_the_required_tables_are_checked():
    for page, ids in REQUIRED.items():
        tables, errors = find_tables(_page(page), page)
        assert not errors, errors
        have = {t.spec.get("id") for t in tables}
        assert ids <= have, f"{page}: tables {sorted(ids - have)} are no longer checked"
        for t in tables:
            assert t.rows, f"{page}: table {t.spec.get('id')!r} has no rows"


def _alter_first(text: str, table_id: str, col: str, old: str, new: str) -> tuple[str, str]:
    """``text`` with ``old`` replaced by ``new`` in column ``col`` of the first row of table ``table_id``."""
    tables, _ = find_tables(text, "x")
    table = next(t for t in tables if t.spec.get("id") == table_id)
    line_no, cells = table.rows[0]
    ci = table.header.index(col)
    assert old in cells[ci], cells[ci]
    cells = list(cells)
    cells[ci] = cells[ci].replace(old, new, 1)
    lines = text.splitlines()
    lines[line_no] = "| " + " | ".join(cells) + " |"
    return "\n".join(lines) + "\n", strip_md(cells[0])


def test_a_hand_edited_number_fails_naming_page_table_cell_and_both_values():
    page = "papers/dispfl/README.md"
    text = _page(page)
    assert not check_text(text, page).errors
    tables, _ = find_tables(text, page)
    table = next(t for t in tables if t.spec.get("id") == "dispfl-trajectory")
    cell = table.rows[0][1][table.header.index("r200")]
    true = numbers(cell)[0]
    edited = f"{float(true) + 0.1:.1f}"
    altered, row = _alter_first(text, "dispfl-trajectory", "r200", true, edited)
    errors = check_text(altered, page).errors
    assert len(errors) == 1, errors
    msg = errors[0]
    for part in (page, "'dispfl-trajectory'", f"row {row!r}", "column 'r200'", f"page says {edited}",
                 f"the records give {true}"):
        assert part in msg, (part, msg)


def test_a_stale_seed_count_fails():
    page = "papers/fedspa/README.md"
    text = _page(page)
    tables, _ = find_tables(text, page)
    table = next(t for t in tables if t.spec.get("id") == "fedspa-200")
    cell = table.rows[0][1][table.header.index("personal acc % (r200)")]
    n = re.search(r"\((\d+)\)", cell).group(1)
    altered, _ = _alter_first(text, "fedspa-200", "personal acc % (r200)", f"({n})", f"({int(n) + 1})")
    errors = check_text(altered, page).errors
    assert errors and f"page says {int(n) + 1}, the records give {n}" in errors[0], errors


def test_an_unmapped_number_fails():
    text = """<!-- numbers
id: t
dir: papers/fedspa/records/long_horizon
rows: {DisPFL: dispfl}
cols: {acc: '{r.final.acc_mean*100:.1f}'}
-->

| run | acc | note |
|---|---|---|
| DisPFL | 66.7 | 12 |
"""
    errors = check_text(text, "page.md").errors
    assert len(errors) == 1 and "column 'note'" in errors[0] and "unmapped" in errors[0], errors
    assert not check_text(text.replace("| 12 |", "| n/a |"), "page.md").errors


def test_rows_and_columns_must_match_the_spec():
    base = """<!-- numbers
id: t
dir: papers/fedspa/records/long_horizon
rows: {DisPFL: dispfl, Local: dispfl_local}
cols: {acc: '{r.final.acc_mean*100:.1f}'}
-->

| run | acc |
|---|---|
| DisPFL | 66.7 |
"""
    errors = check_text(base, "page.md").errors
    assert errors == ["page.md, table 't': the spec's row 'Local' is not in the table"], errors
    errors = check_text(base + "| Other | 1.0 |\n", "page.md").errors
    assert any("row 'Other' has no entry" in e for e in errors), errors
    errors = check_text(base.replace("cols: {acc:", "cols: {accuracy:"), "page.md").errors
    assert any("names column 'accuracy'" in e for e in errors), errors


def test_seed_groups_match_pl_fed_report():
    """The seed cells use ``pl-fed report``'s format and arithmetic (mean ± sample std (n)); its seeds.md gave
    64.85 ± 1.85 (3) for DisPFL and 64.79 ± 2.08 (3) for Local at 200 rounds (docs/outputs.md, "How do I read a gap
    between two methods?")."""
    records = Records(REPO)
    base = REPO / "papers/fedspa/records/long_horizon"
    for spec, want in (("dispfl dispfl_seed[12]", "64.85 ± 1.85 (3)"), ("dispfl_local dispfl_local_seed[12]",
                                                                       "64.79 ± 2.08 (3)")):  # (seeds 0-2)
        values = [100 * r.final.acc_mean for r in resolve_runs(records, base, spec)]
        assert seeds_text(values, 2) == want
    assert seeds_text([58.08], 2) == "58.08 (1)"
    assert Claim([64.85], [1.0]).verdict == "not shown (one seed)"


def test_claims_use_paired_statistics_and_agree_with_scipy():
    """A claim over runs on the same seeds is a paired t-test (its interval, p and verdict equal scipy's); over runs
    that cannot be paired, Welch's; the verdict comes from the 95 % interval."""
    stats = pytest.importorskip("scipy.stats")
    a = Values([71.0, 72.5, 73.1], [("s", 0), ("s", 1), ("s", 2)])
    b = Values([71.6, 70.0, 71.4], [("s", 2), ("s", 0), ("s", 1)])
    c = Claim(a, b)
    pa, pb = [71.0, 72.5, 73.1], [70.0, 71.4, 71.6]  # b reordered by seed
    ref = stats.ttest_rel(pa, pb)
    lo, hi = ref.confidence_interval(0.95)
    assert c.stats["test"] == "paired" and abs(c.stats["p"] - ref.pvalue) < 1e-9
    assert abs(c.stats["lo"] - lo) < 1e-9 and abs(c.stats["hi"] - hi) < 1e-9
    assert c.verdict == f"holds (95 % CI {lo:+.2f} to {hi:+.2f}, p {ref.pvalue:.3f}; paired, 3 seeds)"
    unpaired = Claim([71.0, 72.5, 73.1], [70.0, 70.9, 71.2])  # no seeds: Welch
    w = stats.ttest_ind([71.0, 72.5, 73.1], [70.0, 70.9, 71.2], equal_var=False)
    assert unpaired.stats["test"] == "Welch" and abs(unpaired.stats["p"] - w.pvalue) < 1e-9
    assert Claim(Values([3.0, 5.0, 4.0], [1, 2, 3]), Values([1.0, 1.2, 1.1], [1, 2, 3])).verdict.startswith("holds")
    assert Claim(Values([1.0, 1.2, 1.1], [1, 2, 3]), Values([3.0, 5.0, 4.0], [1, 2, 3])).verdict.startswith("reversed")
    assert Claim(Values([3.0, 5.0, 4.0], [1, 2, 3]), Values([3.5, 3.7, 3.6], [1, 2, 3])).verdict.startswith("not shown")
    level = Claim(Values([3.0, 5.0, 4.0], [1, 2, 3]), Values([3.5, 3.7, 3.6], [1, 2, 3]))
    assert level.same_verdict.startswith("no difference shown")
    assert Claim(Values([3.0, 5.0], [1, 2]), Values([1.0, 1.2], [1, 2])).verdict.endswith("paired, 2 seeds)")
    # more seeds on one side: paired on the seeds both have (as pl-fed report pairs), the gap theirs
    more = Claim(Values([71.0, 72.5, 73.1, 60.0, 61.0], [("s", k) for k in range(5)]), b)
    assert more.stats["test"] == "paired" and abs(more.stats["p"] - ref.pvalue) < 1e-9
    assert abs(more.gap - (sum(pa) - sum(pb)) / 3) < 1e-12 and more.verdict.endswith("paired, 3 seeds)")
    assert Claim(Values([1.0, 2.0, 3.0], [0, 1, 2]), Values([1.0, 2.0, 3.0], [2, 5, 6])).stats["test"] == "Welch"


def test_every_summary_equals_its_last_metrics_row():
    """A run record's ``summary.json`` says what its ``metrics.jsonl`` ends with: the ``final`` row is the last
    row, key for key (a hand-edited summary, or a metrics file cut short, is caught)."""
    problems = summary_mismatches(REPO)
    assert not problems, "\n".join(problems[:20])


def test_an_edited_summary_is_caught(tmp_path):
    run = tmp_path / "benchmarks" / "r"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"round": 0, "acc_mean": 0.5}) + "\n")
    (run / "summary.json").write_text(json.dumps({"final": {"round": 0, "acc_mean": 0.5}}))
    assert summary_mismatches(tmp_path) == []
    (run / "summary.json").write_text(json.dumps({"final": {"round": 0, "acc_mean": 0.51}}))
    (problem,) = summary_mismatches(tmp_path)
    assert "benchmarks/r/summary.json" in problem and "acc_mean" in problem and "0.51" in problem


def test_a_glob_starting_with_a_slash_is_relative_to_the_repository(tmp_path):
    for name in ("a", "a_seed1", "a_seed2"):
        (tmp_path / "benchmarks" / "long" / name).mkdir(parents=True)
        (tmp_path / "benchmarks" / "long" / name / "summary.json").write_text("{}")
    (tmp_path / "benchmarks" / "table").mkdir()
    runs = resolve_runs(Records(tmp_path), tmp_path / "benchmarks" / "table",
                        "/benchmarks/long/a /benchmarks/long/a_seed*")
    assert [r.name for r in runs] == ["a", "a_seed1", "a_seed2"]


def paper_texts(shared: Path = REPO.parent / "shared" / "papers") -> dict[str, Path]:
    """The papers' text dumps by the names ``papers/quoted.yaml`` uses (``pfedgate``, ``dmpfl``...), read from the
    dumps' README table (file | method — title | venue); empty where the shared folder is absent."""
    readme = shared / "README.md"
    if not readme.exists():
        return {}
    out = {}
    for line in readme.read_text().splitlines():
        cells = split_row(line) if line.startswith("|") else []
        if len(cells) >= 2 and cells[0].strip("`").endswith(".txt"):
            name = re.sub(r"[^a-z0-9]", "", cells[1].split("—")[0].lower())
            out[name] = shared / cells[0].strip("`")
    return out


def quoted_not_in_text(data: dict, texts: dict[str, Path]) -> list[str]:
    """One line per quoted value (``papers/quoted.yaml``'s ``data``) with a number that its paper's text does not
    print, and per entry without a citation or a ``where``; papers without a text are not read."""
    out = []
    for name, paper in data.items():
        if not paper.get("cite"):
            out.append(f"{QUOTED}: paper {name!r} has no cite")
        printed = set(numbers(texts[name].read_text())) if name in texts else None
        for key, entry in (paper.get("values") or {}).items():
            if not isinstance(entry, dict) or not entry.get("where") or "value" not in entry:
                out.append(f"{QUOTED}: {name} {key}: write {{value: ..., where: <table / figure / section>}}")
                continue
            for n in numbers(str(entry["value"])):
                if printed is not None and n not in printed:
                    out.append(f"{QUOTED}: {name} {key} = {entry['value']!r}: the paper's text has no {n} "
                               f"(said to be in {entry['where']})")
    return out


def test_quoted_paper_values_are_in_the_papers():
    """Every number quoted from a paper (``papers/quoted.yaml``) is printed in that paper's text (where the text
    dumps are present: the shared folder beside the repository)."""
    data = quoted()
    assert set(data) == {"pfedgate", "fedspa", "fedpse", "dmpfl", "dispfl"}
    texts = paper_texts()
    if texts:
        assert set(data) <= set(texts), sorted(texts)
    problems = quoted_not_in_text(data, texts)
    assert not problems, "\n".join(problems)
    if not texts:
        pytest.skip("the papers' text dumps are not here: values not compared with the papers")


def test_number_extraction():
    assert numbers("**69.1** (best 67.5 %)") == ["69.1", "67.5"]
    assert numbers("1.6-8.7, −1.0, +0.63, 2.960e+13, 32/26/48") == ["1.6", "8.7", "-1.0", "+0.63", "2.960e+13",
                                                                      "32", "26", "48"]
    assert numbers("45.01 (r34), VGG11-GN, round 34") == ["45.01", "34"]


# ----------------------------------------------------------------------- prose, coverage, sources: probes
def _without_spec(text: str, kind: str, spec_id: str) -> str:
    """``text`` without the ``<!-- kind -->`` comment whose id is ``spec_id``."""
    rx = PROSE_RE if kind == "prose" else SPEC_RE
    m = next(m for m in rx.finditer(text) if (yaml.safe_load(m.group(1)) or {}).get("id") == spec_id)
    return text[:m.start()] + text[m.end():]


_QUICK = """<!-- prose
id: q
dir: benchmarks
run: quickstart
nums: ['{r.s.num_clients}', '{cfg("quickstart/config.yaml", "trainer.num_rounds")}', '{r.final.acc_mean*100:.2f}']
-->
The quickstart's 20 clients (`CIFAR-10` is not it, see Table 2 and Eq. 3) train for 10
rounds and end at **67.13** % ([the record](quickstart5/summary.json)).

Next paragraph, without numbers.
"""


def test_prose_numbers_are_compared_in_order_and_a_changed_one_fails_with_one_line():
    result = check_text(_QUICK, "page.md")
    assert not result.errors and result.checked == 3, result.errors
    errors = check_text(_QUICK.replace("**67.13**", "**67.14**"), "page.md").errors
    assert errors == ["page.md:8: prose 'q': number 3 reads 67.14, the records give 67.13"], errors
    errors = check_text(_QUICK.replace("train for 10", "train for 10 or 11"), "page.md").errors
    assert len(errors) == 1 and "number 3 reads 11 (line 7)" in errors[0] and "the records give 67.13" in errors[0], \
        errors
    errors = check_text(_QUICK.replace("end at **67.13** %", "end"), "page.md").errors
    assert len(errors) == 1 and "number 3 is missing" in errors[0], errors


def test_a_changed_prose_number_on_a_page_fails_with_one_line():
    page = "README.md"
    text = _page(page)
    assert not check_text(text, page).errors
    old = "re-run at CPU scale (10-25 clients"
    assert old in text
    errors = check_text(text.replace(old, "re-run at CPU scale (10-24 clients"), page).errors
    assert len(errors) == 1 and "prose 'readme-claims-scale': number 2 reads 24, the records give 25" in errors[0], \
        errors


def test_a_deleted_prose_spec_leaves_its_numbers_uncovered():
    assert not check_text(_QUICK, "page.md").errors
    errors = check_text(_without_spec(_QUICK, "prose", "q"), "page.md").errors
    assert errors == ["page.md:2: the number(s) 20, 10 in prose come from no <!-- prose --> spec",
                      "page.md:3: the number(s) 67.13 in prose come from no <!-- prose --> spec"], errors


def test_a_deleted_table_spec_fails():
    page = "README.md"
    text = _page(page)
    errors = check_text(_without_spec(text, "numbers", "readme-quickstart"), page).errors
    assert len(errors) == 1 and "a table with numbers (67.13, 61.20) has no <!-- numbers --> spec" in errors[0], errors
    line = int(errors[0].split(":")[1])
    assert _without_spec(text, "numbers", "readme-quickstart").splitlines()[line - 1].startswith("| model |")


def test_a_table_of_labels_only_needs_no_spec():
    text = "| paper | where |\n|---|---|\n| DM-PFL | Table 2, Eq. 3, CIFAR-10-C, `lr: 0.1` |\n"
    assert not check_text(text, "page.md").errors
    assert check_text(text.replace("Eq. 3", "0.3"), "page.md").errors


def test_a_changed_paper_column_number_fails():
    page = "README.md"
    text = _page(page)
    altered = text.replace("| 88.2 vs 69.4 |", "| 88.3 vs 69.4 |")
    assert altered != text
    errors = check_text(altered, page).errors
    assert len(errors) == 1 and "column \"the paper's numbers\"" in errors[0] and \
        "page says 88.3, the records give 88.2" in errors[0], errors


def test_paper_values_read_as_printed(tmp_path):
    (tmp_path / "papers").mkdir()
    (tmp_path / "papers" / "quoted.yaml").write_text(
        "fedx:\n  cite: A. Author, 'Title', Venue 2020\n  values:\n"
        "    t1.acc: {value: \"85.70±0.2\", where: Table 1}\n    t1.frac: {value: \"0.9334\", where: Table 1}\n")
    ns = {"paper": lambda n, k: quoted_value(tmp_path, n, k)}
    assert render('{paper("fedx", "t1.acc")}', ns) == "85.70±0.2"
    assert render('{paper("fedx", "t1.acc"):.1f} / {100*paper("fedx", "t1.frac"):.2f}', ns) == "85.7 / 93.34"
    with pytest.raises(LookupError, match="no value 't1.other'"):
        render('{paper("fedx", "t1.other")}', ns)


def test_a_value_quoted_twice_under_one_name_fails(tmp_path):
    (tmp_path / QUOTED).parent.mkdir(parents=True)
    (tmp_path / QUOTED).write_text("fedspa:\n  values:\n    a: {value: '1', where: T1}\n    a: {value: '2', where: T1}\n")
    with pytest.raises(yaml.constructor.ConstructorError, match="'a' is given twice"):
        quoted(tmp_path)


def test_a_quoted_value_not_in_the_paper_text_fails(tmp_path):
    (tmp_path / "README.md").write_text("| file | method | venue |\n|---|---|---|\n"
                                        "| `000_x.txt` | Fed-X — A Title | ICML 2099 |\n")
    (tmp_path / "000_x.txt").write_text("Table 1: accuracy. Fed-X 85.70±0.2 and Local 61.55±0.2\n")
    texts = paper_texts(tmp_path)
    assert texts == {"fedx": tmp_path / "000_x.txt"}
    data = {"fedx": {"cite": "A. Author, Title, ICML 2099",
                     "values": {"t1.fedx": {"value": "85.70±0.2", "where": "Table 1"}}}}
    assert quoted_not_in_text(data, texts) == []
    data["fedx"]["values"]["t1.fedx"]["value"] = "85.71±0.2"
    assert quoted_not_in_text(data, texts) == [f"{QUOTED}: fedx t1.fedx = '85.71±0.2': the paper's text has no 85.71 "
                                               "(said to be in Table 1)"]
    data["fedx"]["values"]["t1.fedx"] = "85.70"  # no where
    assert "write {value: ..., where:" in quoted_not_in_text(data, texts)[0]
    assert paper_texts(tmp_path / "absent") == {}


def test_a_template_that_writes_its_own_number_is_rejected():
    table = """<!-- numbers
id: t
dir: benchmarks
rows: {q: quickstart}
cols: {rounds: '{len(r.rows)} / 10'}
-->

| run | rounds |
|---|---|
| q | 10 / 10 |
"""
    errors = check_text(table, "page.md").errors
    assert len(errors) == 1 and "writes 10 itself" in errors[0], errors
    fixed = table.replace("'{len(r.rows)} / 10'", "'{len(r.rows)} / {r.s.num_rounds}'")
    assert not check_text(fixed, "page.md").errors
    for bad in ("'{len(r.rows)} / {10}'", "'{len(r.rows)} / {2*5}'"):
        errors = check_text(table.replace("'{len(r.rows)} / 10'", bad), "page.md").errors
        assert len(errors) == 1 and "itself" in errors[0], (bad, errors)
    errors = check_text(_QUICK.replace("'{r.s.num_clients}'", "'20'"), "page.md").errors
    assert len(errors) == 1 and "template 1 '20' writes 20 itself" in errors[0], errors


def test_sources_cfg_default_const():
    ns = _namespace(Records(REPO), REPO, {})
    assert render('{cfg("configs/quickstart.yaml", "trainer.num_rounds")}', ns) == \
        str(yaml.safe_load((REPO / "configs/quickstart.yaml").read_text())["trainer"]["num_rounds"])
    import inspect

    from pl_fedsparse.callbacks import Ditto

    want = inspect.signature(Ditto).parameters["lam"].default
    assert render('{default("pl_fedsparse.callbacks.Ditto", "lam")}', ns) == str(want)
    assert render('{100*const("pl_fedsparse.run.stats.CONFIDENCE"):.0f}', ns) == "95"
    with pytest.raises(LookupError, match="no key"):
        render('{cfg("configs/quickstart.yaml", "trainer.no_such")}', ns)


def test_the_label_rule():
    """Numbers that name rather than measure are not values (the module docstring lists the rule)."""
    assert prose_numbers("Eq. 3, Eqs. (3)-(4), §5.1, Tables 2 and 3, Tab. 1, Fig. 3, App. C.1, Algorithm 1 line 7, "
                         "Alg. 4, Phase 2") == []
    assert prose_numbers("VGG11, ResNet18, CIFAR-10, CIFAR-10-C, Fashion-MNIST, FEMNIST, top-1") == []
    assert prose_numbers("torch 2.14.1, v1.2, Python 3.11, on 2026-11-26, (Li et al., 2023), ICML 2022, "
                         "arXiv:2201.11380, doi 10.1145/3580305.3599311") == []
    assert prose_numbers("1. an item [2] with `lr: 0.1` and [a link](x_3.md) <!-- 7 -->") == []
    assert prose_numbers("Dir(0.3) with 100 clients, 10 % sampled, 66.7 ± 1.2 (3) after round 15, Table") == \
        ["0.3", "100", "10", "66.7", "1.2", "3", "15"]
    assert prose_numbers("Table 2, 0.3 and Phase 2 and 100 clients") == ["0.3", "100"]


def test_no_table_skips_a_column():
    """``skip:`` (which hid a column's numbers while the paper columns were converted to ``paper(...)``) is gone:
    a spec that uses it is one error line."""
    text = _page("README.md")
    assert not [t for page in PAGES for t in find_tables(_page(page), page)[0] if "skip" in t.spec]
    spec = SPEC_RE.search(text)
    assert spec is not None
    planted = text[:spec.end() - 3] + "skip: [x]\n" + text[spec.end() - 3:]
    errors = [e for e in check_text(planted, "README.md").errors if "skip" in e]
    assert len(errors) == 1 and "'skip:' is not allowed" in errors[0], errors


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_pages_links_resolve():
    """Links in every page (``PAGES``: the README, the docs, the papers' folders, the engine studies' pages) point at
    files and headings that exist."""
    pages = [REPO / p for p in PAGES]
    names = {str(p.relative_to(REPO)) for p in pages}
    assert {"docs/usage.md", "docs/outputs.md", "docs/methods.md", "docs/scaling.md", "papers/README.md",
            "papers/dmpfl/README.md", "papers/fedpse/baselines.md", "benchmarks/README.md",
            "benchmarks/ENGINE.md"} <= names
    bad = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md":
                slugs = {_slug(h) for h in re.findall(r"^#+ (.+)$", dest.read_text(), flags=re.MULTILINE)}
                if anchor not in slugs:
                    bad.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert not bad, "\n".join(bad)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--write"]:
        for page in argv[1:]:
            text = _page(page)
            new, result = rewrite(text, page)
            (REPO / page).write_text(new)
            print(f"{page}: {len(result.rewritten)} row(s) rewritten from the records; "
                  f"{len([e for e in result.errors if 'cannot compute' in e or 'spec' in e])} problem(s)")
            for e in result.errors:
                if "page says" not in e:
                    print("  ", e)
        return 0
    pages = [a for a in argv if not a.startswith("--")] or PAGES
    total = 0
    for page in pages:
        text = _page(page)
        result = check_text(text, page)
        total += result.checked
        print(f"{page}: {len(result.tables)} checked table(s) and prose block(s), {result.checked} numbers, "
              f"{len(result.errors)} error(s)")
        for e in result.errors:
            print("  ", e)
    print(f"{total} numbers checked")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
