"""Old path of :mod:`pl_fedsparse.executors.base` and :mod:`pl_fedsparse.executors.in_process` (kept so that
existing imports and configs work)."""

from pl_fedsparse.executors.base import *  # noqa: F401,F403
from pl_fedsparse.executors.base import __all__ as _base_all
from pl_fedsparse.executors.in_process import InProcessExecutor  # noqa: F401

__all__ = [*_base_all, "InProcessExecutor"]
