"""``pl-fed``'s own subcommands: ``configs`` (the shipped configs with their descriptions), ``report`` and
``sweep`` — :func:`run_own`.

None of them needs torch or Lightning in the ``pl-fed`` process (a sweep's runs and entry checks are processes of
their own), so this module imports neither and the console script (:mod:`pl_fedsparse.cli.entry`) runs them before
importing :mod:`pl_fedsparse.cli.commands`: they answer at once instead of after seconds of imports.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from pl_fedsparse import shipped
from pl_fedsparse.cli.help import PROG

__all__ = ["CONFIGS_USAGE", "list_configs", "run_own"]


CONFIGS_USAGE = f"""usage: {PROG} configs

List the configs shipped with pl_fedsparse: the name, then the description (the file's leading comment lines,
without its example command), wrapped to the terminal's width. Run one by name from any directory:
`{PROG} fit --config NAME.yaml` (or NAME); a file of that name in the working directory wins over the shipped one.
The shipped files are in: {{folder}}
"""


def list_configs(args: Sequence[str]) -> int:
    """``pl-fed configs``: print the shipped configs with their descriptions.

    Args:
        args: the words after ``configs`` (only ``-h``/``--help`` is accepted).

    Returns:
        The exit status: 0, or 2 after a one-line error.
    """
    if list(args) in (["-h"], ["--help"]):
        sys.stdout.write(CONFIGS_USAGE.format(folder=shipped.config_dir()))
        return 0
    if args:
        sys.stderr.write(f"error: unrecognized arguments: {' '.join(args)} (`{PROG} configs` takes none; see "
                         f"`{PROG} configs --help`)\n")
        return 2
    listing = shipped.format_listing()
    if not listing:
        sys.stderr.write(f"error: no shipped configs in {shipped.config_dir()} (the installation is incomplete: "
                         f"reinstall pl_fedsparse)\n")
        return 2
    sys.stdout.write(listing)
    return 0


def run_own(words: Sequence[str]) -> int | None:
    """Run ``words`` (the command line after ``pl-fed``) when its first word is one of ``pl-fed``'s own
    subcommands (:data:`~pl_fedsparse.cli.help.OWN_SUBCOMMANDS`); ``None`` when it is not.

    Returns:
        The subcommand's exit status, or ``None``.
    """
    name, args = (words[0], list(words[1:])) if words else ("", [])
    if name == "configs":
        return list_configs(args)
    if name == "report":  # compare run directories (pl_fedsparse.run.report)
        from pl_fedsparse.run.report import main as report_main

        return report_main(args)
    if name == "sweep":  # a campaign of runs (pl_fedsparse.sweep)
        from pl_fedsparse.sweep import main as sweep_main

        return sweep_main(args)
    return None
