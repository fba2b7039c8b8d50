"""``pl-fed configs``: the configs shipped with the package, listed with their descriptions.

A module of its own, importing neither torch nor Lightning: the console script (:mod:`pl_fedsparse.cli.entry`)
runs it directly, so the first command a new user types answers at once instead of after seconds of imports.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from pl_fedsparse import shipped
from pl_fedsparse.cli.help import PROG

__all__ = ["CONFIGS_USAGE", "list_configs"]


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
