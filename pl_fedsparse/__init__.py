"""pl_fedsparse: a PyTorch Lightning trainer for personalized sparse federated learning.

The public names below are imported on first use (PEP 562 ``__getattr__``), so that ``import pl_fedsparse`` does
not load torch and Lightning before anyone needs them: the ``pl-fed`` command installs its signal handlers first
(a Ctrl-C while torch loads is then one line, not a traceback). ``from pl_fedsparse import FederatedLoop`` and
``pl_fedsparse.callbacks`` work as with eager imports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pl_fedsparse import _moved

_moved.install()  # old module paths (pl_fedsparse.report, pl_fedsparse.rundir, ...) keep working

if TYPE_CHECKING:
    from pl_fedsparse.callbacks.base import FederatedCallback
    from pl_fedsparse.client import ClientStateStore, ClientUpdate, Message
    from pl_fedsparse.context import FitContext, FitKind, FitSpec, FitStage, current_fit
    from pl_fedsparse.errors import CheckpointError, ConfigError
    from pl_fedsparse.executors import ClientExecutor, FitRequest, InProcessExecutor
    from pl_fedsparse.loop import FederatedLoop
    from pl_fedsparse.module import FederatedModule
    from pl_fedsparse.topology import FullyConnected, RandomPeers, Ring, Star, Topology

__version__ = "0.1.0"

#: each public name -> the module that defines it (imported when the name is first read)
_PUBLIC: dict[str, str] = {
    "FederatedLoop": "pl_fedsparse.loop", "FederatedModule": "pl_fedsparse.module",
    "FederatedCallback": "pl_fedsparse.callbacks.base",
    **dict.fromkeys(("ClientUpdate", "ClientStateStore", "Message"), "pl_fedsparse.client"),
    **dict.fromkeys(("FitContext", "FitKind", "FitSpec", "FitStage", "current_fit"), "pl_fedsparse.context"),
    **dict.fromkeys(("ClientExecutor", "FitRequest", "InProcessExecutor"), "pl_fedsparse.executors"),
    **dict.fromkeys(("Topology", "Star", "Ring", "FullyConnected", "RandomPeers"), "pl_fedsparse.topology"),
    **dict.fromkeys(("ConfigError", "CheckpointError"), "pl_fedsparse.errors"),
}

__all__ = [
    "FederatedLoop", "FederatedModule", "FederatedCallback", "ClientUpdate", "ClientStateStore", "Message",
    "FitContext", "FitKind", "FitSpec", "FitStage", "current_fit", "ClientExecutor", "FitRequest", "InProcessExecutor",
    "Topology", "Star", "Ring", "FullyConnected", "RandomPeers", "ConfigError", "CheckpointError", "__version__",
]

__getattr__ = _moved.lazy_exports(__name__, _PUBLIC, submodules=True)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
