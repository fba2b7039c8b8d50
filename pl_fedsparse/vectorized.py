"""Old path of :mod:`pl_fedsparse.executors.vectorized` (kept so that existing imports and configs work)."""

from pl_fedsparse.executors.vectorized import *  # noqa: F401,F403
from pl_fedsparse.executors.vectorized import __all__  # noqa: F401
