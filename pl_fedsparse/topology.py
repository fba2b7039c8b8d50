"""Who talks to whom in a round.

A topology answers one question: from which nodes does a client receive its starting point in round ``t``? The
loop and the methods' callbacks use the answer; the loop itself has no special case per topology.

* :class:`Star` — the server (node :data:`~pl_fedsparse.metrics.SERVER`) talks to every participating client.
  FedAvg, FedSpa, DM-PFL, pFedGate and FedPSE use it.
* Peer topologies (ring, fully connected, random k-pull per round) subclass :class:`Topology` with
  ``has_server = False``; DisPFL and D-PSGD use them. Their neighbour draws must be seeded by ``(seed, round)``
  so that a run is reproducible and resumable.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from pl_fedsparse.metrics import SERVER

__all__ = ["Topology", "Star"]


class Topology(ABC):
    """Base class: the communication graph of a round."""

    #: whether a server node exists (and holds a global model)
    has_server: bool = True

    @abstractmethod
    def neighbors(self, round_idx: int, client_idx: int, clients: Sequence[int], seed: int) -> list[int]:
        """The nodes ``client_idx`` receives from in ``round_idx``.

        Args:
            round_idx: 0-based round.
            client_idx: the receiving client.
            clients: all clients of the federation (or the round's participants).
            seed: the federation seed; random topologies draw from ``(seed, round_idx)``.
        """


class Star(Topology):
    """Every client exchanges messages with the server only.

    Example:
        >>> Star().neighbors(3, 7, range(10), seed=0)
        [-1]
    """

    has_server = True

    def neighbors(self, round_idx: int, client_idx: int, clients: Sequence[int], seed: int) -> list[int]:
        return [SERVER]
