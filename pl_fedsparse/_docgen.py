"""The "Hook reference" of ``docs/extending.md``, generated from :class:`~pl_fedsparse.callbacks.FederatedCallback`.

Every public method the class defines itself — broadcast hooks, collected hooks, policies and the per-client state
helpers — with its exact signature (:func:`inspect.signature`, annotations as written in the source) and the first
paragraph of its docstring, between the markers ``<!-- hook-signatures:start -->`` and ``<!-- hook-signatures:end
-->``. ``tests/test_extending_doc.py`` fails when the doc and the code differ; regenerate with::

    python -m pl_fedsparse._docgen --write          # rewrites the block in docs/extending.md
    python -m pl_fedsparse._docgen                  # prints the block
    python -m pl_fedsparse._docgen --check          # exit status 1 when docs/extending.md is out of date
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["DOC", "END", "START", "hook_kinds", "hook_reference", "main", "signature_text", "splice"]

#: the document the block lives in (a source checkout)
DOC = Path(__file__).resolve().parents[1] / "docs" / "extending.md"
START = "<!-- hook-signatures:start -->"
END = "<!-- hook-signatures:end -->"

#: section titles, in the order they appear
KINDS = {
    "broadcast": "Broadcast hooks (called on every callback; return `None`)",
    "collected": "Collected hooks (called on every callback; the loop gathers the returned lists)",
    "policy": "Policies (one owner: the callback whose class overrides it; the base versions are never called)",
    "declaration": "Declarations (questions the loop asks about the callback; they change nothing)",
    "state": "Per-client state helpers (call them; don't override them)",
}


def _callback_class() -> type:
    from pl_fedsparse.callbacks.base import FederatedCallback

    return FederatedCallback


def _annotation(ann: Any) -> str:
    """An annotation as written: a string under ``from __future__ import annotations``, else formatted."""
    return ann if isinstance(ann, str) else inspect.formatannotation(ann)


def signature_text(name: str, fn: Callable[..., Any]) -> str:
    """``name(arg: Type, ...) -> Return`` without ``self``.

    Example:
        >>> def f(self, loop: FederatedLoop, k: int = 0) -> list[int]: ...  # annotations stay strings here
        >>> signature_text("f", f)
        'f(loop: FederatedLoop, k: int = 0) -> list[int]'
    """
    sig = inspect.signature(fn)
    parts = []
    for p in list(sig.parameters.values())[1:]:  # without self
        text = p.name if p.kind is not p.VAR_POSITIONAL else f"*{p.name}"
        text = text if p.kind is not p.VAR_KEYWORD else f"**{p.name}"
        if p.annotation is not p.empty:
            text += f": {_annotation(p.annotation)}"
        if p.default is not p.empty:
            text += f" = {p.default!r}"
        parts.append(text)
    ret = "" if sig.return_annotation is sig.empty else f" -> {_annotation(sig.return_annotation)}"
    return f"{name}({', '.join(parts)}){ret}"


def _summary(fn: Callable[..., Any]) -> str:
    """The first paragraph of the docstring, in one line, with reST roles and literals as Markdown code."""
    doc = inspect.getdoc(fn) or ""
    first = " ".join(doc.split("\n\n", 1)[0].split())
    first = re.sub(r":\w+:`~?([^`]+)`", lambda m: f"`{m.group(1).rsplit('.', 1)[-1]}`", first)
    return first.replace("``", "`")


def hook_kinds(cls: type | None = None) -> dict[str, list[str]]:
    """The public methods ``cls`` (default :class:`FederatedCallback`) defines itself, by kind, in source order.

    A policy is a name in :data:`~pl_fedsparse.callbacks.base.POLICIES`, a declaration one in
    :data:`~pl_fedsparse.callbacks.base.DECLARATIONS`; a state helper ends in
    ``_client_state``; a hook that returns ``None`` is broadcast, any other is collected. Lightning's own hooks,
    properties and class methods are not listed.
    """
    import lightning.pytorch as pl

    from pl_fedsparse.callbacks.base import DECLARATIONS, POLICIES

    cls = _callback_class() if cls is None else cls
    out: dict[str, list[str]] = {kind: [] for kind in KINDS}
    for name, value in vars(cls).items():
        if name.startswith("_") or not inspect.isfunction(value) or hasattr(pl.Callback, name):
            continue
        if name in POLICIES:
            kind = "policy"
        elif name in DECLARATIONS:
            kind = "declaration"
        elif name.endswith("_client_state"):
            kind = "state"
        else:
            ret = inspect.signature(value).return_annotation
            kind = "broadcast" if ret in (None, "None") else "collected"
        out[kind].append(name)
    return out


def hook_reference(cls: type | None = None) -> str:
    """The Markdown block between the markers (markers included)."""
    cls = _callback_class() if cls is None else cls
    note = (f"<!-- generated from pl_fedsparse.callbacks.{cls.__name__} by `python -m pl_fedsparse._docgen --write`;"
            " tests/test_extending_doc.py checks it -->")
    lines = [START, note, ""]
    for kind, names in hook_kinds(cls).items():
        if not names:
            continue
        lines += [f"### {KINDS[kind]}", ""]
        for name in names:
            fn = vars(cls)[name]
            lines.append(f"- `{signature_text(name, fn)}`  ")
            lines.append(f"  {_summary(fn)}")
        lines.append("")
    lines.append(END)
    return "\n".join(lines)


def splice(text: str, block: str) -> str:
    """``text`` with the part between the markers (markers included) replaced by ``block``.

    Raises:
        ValueError: ``text`` lacks the markers.
    """
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the document lacks the markers {START} … {END}")
    return text[:start] + block + text[end + len(END):]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pl_fedsparse._docgen [--write | --check] [--doc PATH]``."""
    ap = argparse.ArgumentParser(prog="python -m pl_fedsparse._docgen", description=__doc__.split("\n\n")[0])
    ap.add_argument("--doc", type=Path, default=DOC, help="the Markdown file (default: docs/extending.md)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite the block in the document")
    mode.add_argument("--check", action="store_true", help="exit 1 when the document's block is out of date")
    args = ap.parse_args(argv)
    block = hook_reference()
    if not (args.write or args.check):
        print(block)
        return 0
    text = args.doc.read_text(encoding="utf-8")
    new = splice(text, block)
    if args.check:
        if new != text:
            print(f"{args.doc}: the hook reference is out of date (run `python -m pl_fedsparse._docgen --write`)",
                  file=sys.stderr)
            return 1
        return 0
    if new != text:
        args.doc.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
