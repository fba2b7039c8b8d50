"""pl_fedsparse: a PyTorch Lightning trainer for personalized sparse federated learning."""

from pl_fedsparse import _moved

_moved.install()  # old module paths (pl_fedsparse.report, pl_fedsparse.rundir, ...) keep working

from pl_fedsparse.callbacks.base import FederatedCallback
from pl_fedsparse.client import ClientStateStore, ClientUpdate, Message
from pl_fedsparse.context import FitContext, FitKind, FitSpec, FitStage, current_fit
from pl_fedsparse.errors import CheckpointError, ConfigError
from pl_fedsparse.executors import ClientExecutor, FitRequest, InProcessExecutor
from pl_fedsparse.loop import FederatedLoop
from pl_fedsparse.module import FederatedModule
from pl_fedsparse.topology import FullyConnected, RandomPeers, Ring, Star, Topology

__version__ = "0.1.0"

__all__ = [
    "FederatedLoop", "FederatedModule", "FederatedCallback", "ClientUpdate", "ClientStateStore", "Message",
    "FitContext", "FitKind", "FitSpec", "FitStage", "current_fit", "ClientExecutor", "FitRequest", "InProcessExecutor",
    "Topology", "Star", "Ring", "FullyConnected", "RandomPeers", "ConfigError", "CheckpointError", "__version__",
]
