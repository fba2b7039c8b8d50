"""``python -m pl_fedsparse.cli``: the ``pl-fed`` command."""

from pl_fedsparse.cli.entry import console_main

console_main()
