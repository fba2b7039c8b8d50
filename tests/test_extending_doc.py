"""docs/extending.md: its table "Hooks in the order they fire" is what a real run calls, in that order, and its
"Hook reference" shows every hook's signature and summary as the code has them (pl_fedsparse._docgen)."""

from __future__ import annotations

import inspect
import re
from collections.abc import Sequence
from itertools import zip_longest
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from conftest import tiny_datamodule, tiny_loop, tiny_module

from pl_fedsparse import FederatedCallback, FitContext, FitSpec, Message, _docgen, current_fit
from pl_fedsparse.callbacks.base import DECLARATIONS, POLICIES
from pl_fedsparse.functional import weighted_average

DOC = Path(__file__).resolve().parents[1] / "docs" / "extending.md"

#: FederatedCallback methods that are helpers, not hooks
HELPERS = {"add_client_state", "get_client_state", "set_client_state", "has_client_state"}
#: policies the recorder owns (with the loop's default behaviour); ``client_masks`` is never called by the loop
RECORDED_POLICIES = ("select_clients", "client_message", "aggregate", "personal_state")


def _functions(cls: type) -> list[str]:
    return sorted(n for n, v in vars(cls).items() if not n.startswith("_") and inspect.isfunction(v))


#: every Lightning callback hook (setup, on_fit_start, ..., state_dict, load_state_dict)
LIGHTNING_HOOKS = _functions(pl.Callback)
#: every federation hook (broadcast and collected) of FederatedCallback
FEDERATION_HOOKS = [n for n in _functions(FederatedCallback)
                    if n not in HELPERS and n not in POLICIES and n not in DECLARATIONS]


def documented_order(text: str) -> list[str]:
    """Hook names of the table between the hook-order markers, one per row, in order.

    A row whose first cell reads ```a` … `b``` stands for the rows from ``a`` to ``b`` above it (the requested fits
    fire the same hooks as a round's fit).
    """
    m = re.search(r"<!-- hook-order:start -->(.*?)<!-- hook-order:end -->", text, flags=re.DOTALL)
    assert m, "docs/extending.md lacks the hook-order markers"
    rows = [line for line in m.group(1).splitlines() if line.startswith("|")][2:]  # skip header and separator
    order: list[str] = []
    for row in rows:
        names = re.findall(r"`(\w+)`", row.split("|")[1])
        if len(names) == 1:
            order += names
        else:
            assert len(names) == 2, f"expected one hook or a range `a` … `b` in the first cell of {row!r}"
            start = order.index(names[0])
            order += order[start: order.index(names[1], start) + 1]
    return order


def collapse_repeats(seq: Sequence[str]) -> list[str]:
    """Show a block that repeats back to back once (shortest blocks first): ``a b a b c -> a b c``.

    This folds the per-batch, per-epoch, per-participant, per-fit, per-client, per-model-kind and per-round
    repetitions of a run into the sequence the table documents.

    Example:
        >>> collapse_repeats(list("xababcababcy"))
        ['x', 'a', 'b', 'c', 'y']
    """
    out = list(seq)
    changed = True
    while changed:
        changed = False
        for size in range(1, len(out) // 2 + 1):
            i = 0
            while i + 2 * size <= len(out):
                if out[i: i + size] == out[i + size: i + 2 * size]:
                    del out[i + size: i + 2 * size]
                    changed = True
                else:
                    i += 1
    return out


class Recorder(FederatedCallback):
    """Records every hook (federation, collected, owned policies, Lightning) by name, in order.

    It owns four policies with the loop's default behaviour, and requests one extra fit at each stage (a
    ``"personal"`` fit before aggregation, a ``"finetune"`` fit after it) so that requested-fit hooks fire.
    """

    scratch_attributes = ("calls", "fit_kinds")  # test records, read in process only

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.fit_kinds: list[str] = []

    # ---- policies, as the loop's defaults ----------------------------------------------------------------------
    def select_clients(self, loop: Any, round_idx: int, client_ids: Sequence[int]) -> list[int]:
        self.calls.append("select_clients")
        return list(client_ids)

    def client_message(self, loop: Any, client_idx: int) -> Message | None:
        self.calls.append("client_message")
        return Message(loop.global_state)

    def aggregate(self, loop: Any, updates: Any) -> Any:
        self.calls.append("aggregate")
        sent = [u for u in updates if u.message is not None]
        return {**loop.global_state, **weighted_average([u.message.tensors for u in sent],
                                                         [u.n_samples for u in sent])}

    def personal_state(self, loop: Any, client_idx: int) -> Any:
        self.calls.append("personal_state")
        return loop.global_state

    # ---- hooks that also check what the doc says about them ----------------------------------------------------
    def fit_requests(self, loop: Any, stage: str, updates: Any) -> list[FitSpec]:
        self.calls.append("fit_requests")
        kind = {"before_aggregate": "personal", "after_aggregate": "finetune"}[stage]
        return [FitSpec(0, kind, loop.global_state)]  # type: ignore[arg-type]

    def on_client_fit_start(self, loop: Any, module: Any, context: FitContext) -> None:
        self.calls.append("on_client_fit_start")
        assert current_fit() is context
        self.fit_kinds.append(context.kind)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.calls.append("on_before_optimizer_step")
        ctx = current_fit()
        assert ctx is not None and ctx.kind == self.fit_kinds[-1]

    def on_client_evaluate_start(self, loop: Any, module: Any, client_idx: int, kind: str) -> None:
        self.calls.append("on_client_evaluate_start")
        assert current_fit() is None and kind in ("personal", "global")


def _recording(name: str) -> Any:
    base = getattr(FederatedCallback, name)

    def hook(self: Recorder, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(name)
        return base(self, *args, **kwargs)

    hook.__name__ = name
    return hook


for _name in LIGHTNING_HOOKS + FEDERATION_HOOKS:
    if _name not in vars(Recorder):
        setattr(Recorder, _name, _recording(_name))


def test_recorder_records_every_hook_and_owns_only_the_recorded_policies() -> None:
    assert {"setup", "on_fit_start", "on_before_optimizer_step", "teardown", "state_dict"} <= set(LIGHTNING_HOOKS)
    assert {"setup_federation", "fit_requests", "on_requested_fits_end", "report_rows"} <= set(FEDERATION_HOOKS)
    assert all(vars(Recorder).get(n) is not None for n in LIGHTNING_HOOKS + FEDERATION_HOOKS)
    assert Recorder.owned_policies() == list(RECORDED_POLICIES)


def test_doc_names_every_federation_hook_and_policy() -> None:
    documented = set(documented_order(DOC.read_text()))
    missing = [n for n in FEDERATION_HOOKS + list(RECORDED_POLICIES) if n not in documented]
    assert not missing, f"docs/extending.md's hook table lacks {missing}"
    assert "client_masks" in DOC.read_text()


def test_hook_table_matches_a_real_run(tmp_path: Path) -> None:
    rec = Recorder()
    loop = tiny_loop(tmp_path, num_rounds=2, local_epochs=1, callbacks=[rec])
    loop.fit(tiny_module(), tiny_datamodule(num_clients=2, batch_size=64))
    # 2 rounds x (2 participants' local fits + 1 requested fit per stage)
    assert rec.fit_kinds == ["train", "train", "personal", "finetune"] * 2
    assert rec.calls.count("on_client_evaluate_start") == 2 * 2 * 2  # rounds x clients x (personal, global)
    recorded = collapse_repeats(rec.calls)
    documented = documented_order(DOC.read_text())
    assert recorded == documented, (
        "docs/extending.md's table 'Hooks in the order they fire' differs from a real run (recorded | documented):\n"
        + "\n".join(f"{i:3d}  {r:28s} {d}"
                    for i, (r, d) in enumerate(zip_longest(recorded, documented, fillvalue="-"))))


# ------------------------------------------------------------------------------------------------ hook reference
def test_hook_reference_is_the_code() -> None:
    """The block between the hook-signatures markers is what ``python -m pl_fedsparse._docgen`` generates now."""
    text = DOC.read_text()
    expected = _docgen.hook_reference()
    assert _docgen.splice(text, expected) == text, (
        "docs/extending.md's 'Hook reference' differs from FederatedCallback: run "
        "`python -m pl_fedsparse._docgen --write` (and review the diff)")


def test_hook_reference_covers_every_hook_and_policy() -> None:
    kinds = _docgen.hook_kinds()
    assert set(kinds["policy"]) == set(POLICIES)
    assert set(kinds["broadcast"] + kinds["collected"]) == set(FEDERATION_HOOKS)
    assert set(kinds["state"]) == HELPERS
    assert kinds["collected"] == ["fit_requests", "eval_views", "report_rows"]
    assert kinds["declaration"] == list(DECLARATIONS)
    block = _docgen.hook_reference()
    for name in FEDERATION_HOOKS + list(POLICIES):
        sig = inspect.signature(getattr(FederatedCallback, name))
        assert f"- `{name}(" in block and all(p in block for p in list(sig.parameters)[1:])
    assert "`on_round_start(loop: FederationView, round_idx: int) -> None`" in block  # annotations as written


class _Changed(FederatedCallback):
    """FederatedCallback with one hook's signature and another's docstring changed."""

    def on_round_start(self, loop: Any, round_idx: int, extra: float = 0.5) -> None:  # type: ignore[override]
        """Called at the start of every round."""

    def on_round_end(self, loop: Any, round_idx: int, metrics: dict[str, Any]) -> None:
        """Something else."""


def test_a_changed_hook_fails_the_check(tmp_path: Path) -> None:
    """What the check does when the code changes: the doc no longer matches, `--check` says so, `--write` fixes it."""
    text = DOC.read_text()
    methods = {n: v for n, v in vars(FederatedCallback).items() if not n.startswith("__")}
    methods.update({n: v for n, v in vars(_Changed).items() if n.startswith("on_")})
    changed = type("FederatedCallback", (), methods)
    block = _docgen.hook_reference(changed)
    assert "on_round_start(loop: Any, round_idx: int, extra: float = 0.5) -> None" in block
    assert "Something else." in block
    assert _docgen.splice(text, block) != text
    doc = tmp_path / "extending.md"
    doc.write_text(text.replace("Called at the start of every round.", "Called at the start of each round."))
    assert _docgen.main(["--check", "--doc", str(doc)]) == 1
    assert _docgen.main(["--write", "--doc", str(doc)]) == 0
    assert doc.read_text() == text and _docgen.main(["--check", "--doc", str(doc)]) == 0
