"""``pl-fed``'s help: the subcommands' one-line help, the epilog of ``pl-fed fit --help``, and class-typed options
summarised (the shipped classes by name, the frameworks' counted) so that the help stays readable.
"""

from __future__ import annotations

import argparse
import re
import textwrap
from collections.abc import Sequence

from jsonargparse import DefaultHelpFormatter

__all__ = ["CONFIG_HELP", "DESCRIPTION", "OWN_SUBCOMMANDS", "PROG", "SUBCOMMAND_EPILOG", "summarize_class_paths"]


PROG = "pl-fed"

DESCRIPTION = ("Personalized sparse federated learning with PyTorch Lightning. `pl-fed configs` lists the shipped "
               "configs; run one with `pl-fed fit --config NAME.yaml` from any directory.")


CONFIG_HELP = ("Path to a configuration file in json or yaml format, or the name of a shipped config (`pl-fed "
               "configs` lists them; a file of that name in the working directory wins).")


#: the subcommands :func:`main` handles itself, before LightningCLI, with their one-line help
OWN_SUBCOMMANDS = {
    "configs": "List the shipped configs with their descriptions (run one with `pl-fed fit --config NAME`).",
    "report": "Compare run directories: a table of their final metrics (markdown + CSV) and figures.",
    "sweep": "Run a campaign (configs x settings x seeds) several runs at a time, resumable, then report it.",
}

#: the end of ``pl-fed fit|validate|test --help``: how to see a class's arguments and address one callback
SUBCOMMAND_EPILOG = f"""\
Class arguments: `model:`, `data:`, `trainer.callbacks`, `trainer.topology`, `trainer.executor` and
`model.backbone` take a class by `class_path` (or its name) with its `init_args`; the help lists the shipped
classes only. Show one class's arguments with `--<option>.help CLASS`, e.g.:

  {PROG} fit --model.help FederatedModule
  {PROG} fit --model.help FederatedModule --model.backbone.help LeNetCIFAR
  {PROG} fit --data.help FederatedDataModule
  {PROG} fit --trainer.callbacks.help DualMask

Override one callback's argument from the command line by class name or position in `trainer.callbacks`
(`--trainer.callbacks.ARG` alone sets the last callback's):

  {PROG} fit --config synthetic_dmpfl --trainer.callbacks.DualMask.iterations 2
  {PROG} fit --config synthetic_dmpfl --trainer.callbacks.0.iterations 2

A small trial: `--trainer.num_rounds 3 --data.max_train_samples 2000`; on a GPU: `--trainer.accelerator gpu`.

`--print_config` shows the resulting configuration; `{PROG} configs` lists the shipped configs."""


#: top-level packages whose classes the help counts instead of listing (torch alone has ~700 ``nn.Module``\ s)
_FRAMEWORKS = ("torch", "torchvision", "torchaudio", "torchmetrics", "torchtext", "lightning", "pytorch_lightning",
               "lightning_fabric", "lightning_utilities")


#: jsonargparse's ``, known subclasses: a.B, c.D)`` at the end of a class-typed option's help
_KNOWN_SUBCLASSES = re.compile(r", known subclasses: ([^()]*)\)\s*$")


def summarize_class_paths(paths: Sequence[str], option: str) -> str:
    """A short text for the classes an option accepts: every class outside the big frameworks listed, grouped by
    module (``pl_fedsparse.models.{LeNetCIFAR, MLP}``), the frameworks' classes counted.

    Example:
        >>> summarize_class_paths(["torch.nn.Linear", "torch.nn.ReLU", "pl_fedsparse.models.MLP",
        ...                        "pl_fedsparse.models.LeNetCIFAR", "my.Net"], "--model.backbone")
        'any subclass by class_path or name; shipped/imported: pl_fedsparse.models.{MLP, LeNetCIFAR}, my.Net; 2 more \
from torch; `--model.backbone.help CLASS` shows its arguments'
    """
    listed: dict[str, list[str]] = {}
    counted: dict[str, int] = {}
    for path in paths:
        top = path.split(".", 1)[0]
        if top in _FRAMEWORKS:
            counted[top] = counted.get(top, 0) + 1
        else:
            module, _, name = path.rpartition(".")
            listed.setdefault(module, []).append(name)
    groups = [(f"{m}." if m else "") + (names[0] if len(names) == 1 else "{" + ", ".join(names) + "}")
              for m, names in listed.items()]
    text = "any subclass by class_path or name"
    if groups:
        text += "; shipped/imported: " + ", ".join(groups)
    if counted:
        total = sum(counted.values())
        text += f"; {total} {'more ' if groups else ''}from " + ", ".join(counted)
    return text + f"; `{option}.help CLASS` shows its arguments"


_RST_ROLE = re.compile(r":[a-z]+:`~?([^`]*?)`")

_SENTENCE_END = re.compile(r"(?<=[a-z0-9)\]'\"])\.\s+(?=[A-Z(])")


def _short_help(text: str, action: argparse.Action) -> str:
    """An option's help for the terminal: reST markup removed (``x`` → x, :class:`~a.B` → B), only the first
    sentence of the argument's description (the whole of it is in the class docstring and the docs), the type left
    out where the choices already show it, and one line for the ``--X.help CLASS`` options.

    Example:
        >>> _short_help("what it does. More. (type: int, default: 1)", argparse.Action(["--a"], "a"))
        'what it does. (type: int, default: 1)'
    """
    if text.startswith("Show the help for the given subclass of"):
        return "its arguments (CLASS: a class path or name)"
    text = _RST_ROLE.sub(lambda m: m.group(1).rsplit(".", 1)[-1], text).replace("``", "")
    m = re.search(r"\s\((required, )?type: ", text)
    body, sep, tail = (text[:m.start()], f" ({m.group(1) or ''}type: ", text[m.end():]) if m else (text, "", "")
    first = _SENTENCE_END.split(body, maxsplit=1)
    if len(first) > 1:
        body = first[0] + "."
    if tail and str(getattr(action, "metavar", "") or "").startswith("{"):  # {skip,raise} already says it
        tail = tail.replace("%(type)s, ", "", 1)
        sep = sep.replace("type: ", "") if tail.startswith("default: ") else sep
    return body + (sep + tail if sep else "")


class _FedHelpFormatter(DefaultHelpFormatter):
    """jsonargparse's help formatter with the "known subclasses" of a class-typed option summarised
    (:func:`summarize_class_paths`) and with paragraphs (blank-line separated; indented lines kept as they are) in
    descriptions and epilogs.

    jsonargparse's ``--X.help CLASS`` builds its parser with ``type(parser)(...)`` and so with this formatter too.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        text = _short_help(super()._get_help_string(action) or "", action)
        m = _KNOWN_SUBCLASSES.search(text)
        if m is None or not action.option_strings:
            return text
        paths = [p.strip() for p in m.group(1).split(",") if p.strip()]
        return text[:m.start()] + ", " + summarize_class_paths(paths, action.option_strings[0]) + ")"

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out = []
        for para in re.split(r"\n\s*\n", text.strip("\n")):
            if all(line.startswith("  ") for line in para.splitlines()):
                out.append("\n".join(indent + line for line in para.splitlines()))
            else:
                out.append(textwrap.fill(" ".join(para.split()), width, initial_indent=indent,
                                         subsequent_indent=indent))
        return "\n\n".join(out)
