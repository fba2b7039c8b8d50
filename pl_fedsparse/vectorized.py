"""Old path of :mod:`pl_fedsparse.executors.vectorized` (kept so that existing imports and configs work): the same
module object."""

import sys

from pl_fedsparse.executors import vectorized as _vectorized

sys.modules[__name__] = _vectorized
