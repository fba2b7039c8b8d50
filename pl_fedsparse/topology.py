"""Who talks to whom in a round.

A topology answers two questions: from which nodes does a client receive its starting point in round ``t``, and which
clients are offline (dropped) that round. The loop and the methods' callbacks use the answers; the loop itself has no
special case per topology.

* :class:`Star` — the server (node :data:`~pl_fedsparse.metrics.SERVER`) talks to every participating client.
  FedAvg, FedSpa, DM-PFL, pFedGate and FedPSE use it.
* Peer topologies (``has_server = False``; DisPFL, D-PSGD): :class:`Ring`, :class:`FullyConnected` and
  :class:`RandomPeers` (each client pulls from ``k`` random peers, redrawn every round). Every random draw is seeded by
  ``(seed, round)``, so a run is reproducible and resumable and the order of processing clients does not matter.

Client dropping (peer topologies, ``drop_prob``): each client is offline with probability ``p`` in a round, drawn
from ``(seed, round)``. ``drop_mode="offline"`` (default): a dropped client neither trains, sends nor receives that
round, and no neighbour list contains it. ``drop_mode="reference"`` reproduces the DisPFL code (``--active``): a
dropped client skips only its own aggregation (it keeps its model, still trains and updates its mask) and may still be
picked as a neighbour by others (only the fully connected topology filters it out).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Literal

import numpy as np

from pl_fedsparse.errors import check
from pl_fedsparse.metrics import SERVER
from pl_fedsparse.streams import STREAM_IDS

__all__ = ["Topology", "Star", "PeerTopology", "Ring", "FullyConnected", "RandomPeers"]

def _rng(seed: int, *keys: int) -> np.random.Generator:
    # the SeedSequence itself (not stream_seed): kept as the topologies always drew, so results do not change
    return np.random.default_rng(np.random.SeedSequence([int(seed) & 0xFFFFFFFF, *keys]))


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
            clients: all clients of the federation.
            seed: the federation seed; random topologies draw from ``(seed, round_idx)``.
        """

    def dropped(self, round_idx: int, num_clients: int, seed: int) -> set[int]:
        """Clients offline in ``round_idx`` (none by default)."""
        return set()

    def validate(self, num_clients: int, seed: int) -> None:
        """Check the topology against the federation before anything is written (a one-line
        :class:`~pl_fedsparse.errors.ConfigError`). By default: round 0's graph is built for every client, so that a
        subclass's own checks in :meth:`neighbors` run at set-up rather than in the first round."""
        clients = range(num_clients)
        for k in clients:
            self.neighbors(0, k, clients, seed)

    def skips_aggregation(self, round_idx: int, client_idx: int, num_clients: int, seed: int) -> bool:
        """Whether ``client_idx`` keeps its own model instead of aggregating this round (reference-code dropping)."""
        return False


class Star(Topology):
    """Every client exchanges messages with the server only.

    Example:
        >>> Star().neighbors(3, 7, range(10), seed=0)
        [-1]
    """

    has_server = True

    def neighbors(self, round_idx: int, client_idx: int, clients: Sequence[int], seed: int) -> list[int]:
        return [SERVER]


class PeerTopology(Topology):
    """A serverless graph with optional client dropping (see the module docstring).

    Args:
        drop_prob: probability that a client is dropped in a round, in [0, 1).
        drop_mode: ``"offline"`` (a dropped client neither trains, sends nor receives) or ``"reference"`` (the
            DisPFL code: it only skips its own aggregation and may still be picked as a neighbour).
    """

    has_server = False

    def __init__(self, *, drop_prob: float = 0.0, drop_mode: Literal["offline", "reference"] = "offline") -> None:
        check(0 <= drop_prob < 1, "topology.drop_prob", drop_prob, "a number in [0, 1)")
        check(drop_mode in ("offline", "reference"), "topology.drop_mode", drop_mode, "one of offline, reference")
        self.drop_prob = float(drop_prob)
        self.drop_mode = drop_mode

    def _drawn_drops(self, round_idx: int, num_clients: int, seed: int) -> set[int]:
        if self.drop_prob <= 0:
            return set()
        draw = _rng(seed, STREAM_IDS["drop"], round_idx).random(num_clients)
        return {int(k) for k in np.flatnonzero(draw < self.drop_prob)}

    def dropped(self, round_idx: int, num_clients: int, seed: int) -> set[int]:
        return self._drawn_drops(round_idx, num_clients, seed) if self.drop_mode == "offline" else set()

    def skips_aggregation(self, round_idx: int, client_idx: int, num_clients: int, seed: int) -> bool:
        return self.drop_mode == "reference" and client_idx in self._drawn_drops(round_idx, num_clients, seed)

    def neighbors(self, round_idx: int, client_idx: int, clients: Sequence[int], seed: int) -> list[int]:
        offline = self.dropped(round_idx, len(clients), seed)
        return [j for j in self._graph(round_idx, client_idx, list(clients), seed) if j not in offline]

    @abstractmethod
    def _graph(self, round_idx: int, client_idx: int, clients: list[int], seed: int) -> list[int]:
        """Neighbours before dropping."""


class Ring(PeerTopology):
    """Each client receives from its two ring neighbours ``(k − 1) mod K`` and ``(k + 1) mod K``.

    Example:
        >>> Ring().neighbors(0, 0, range(5), seed=0)
        [4, 1]
    """

    def _graph(self, round_idx: int, client_idx: int, clients: list[int], seed: int) -> list[int]:
        n = len(clients)
        out = [clients[(client_idx - 1) % n], clients[(client_idx + 1) % n]]
        return [j for j in dict.fromkeys(out) if j != client_idx]


class FullyConnected(PeerTopology):
    """Each client receives from every other client.

    Example:
        >>> FullyConnected().neighbors(0, 2, range(4), seed=0)
        [0, 1, 3]
    """

    def _graph(self, round_idx: int, client_idx: int, clients: list[int], seed: int) -> list[int]:
        return [j for j in clients if j != client_idx]

    def neighbors(self, round_idx: int, client_idx: int, clients: Sequence[int], seed: int) -> list[int]:
        # the reference code's full mode filters dropped clients in both drop modes
        gone = self._drawn_drops(round_idx, len(clients), seed)
        return [j for j in self._graph(round_idx, client_idx, list(clients), seed) if j not in gone]


class RandomPeers(PeerTopology):
    """Each client pulls from ``k`` distinct random other clients, redrawn every round (DisPFL's ``--cs random``).

    The draw for a whole round comes from one generator seeded by ``(seed, round)``. Without a cap the number of
    clients that pull from one node (its out-degree) is unbounded — DisPFL's "at most 10 neighbours" holds for pulls
    only (its busiest node serves ~18 per round). With ``max_out_degree`` each node serves at most that many pullers:
    clients choose in a random order among the peers that still have capacity; if that greedy order runs out of
    capacity, the round uses a random circulant graph instead (client ``π(i)`` pulls from ``π(i+1..i+k)`` for a
    random permutation ``π``), in which every node serves exactly ``k``.

    Args:
        k: peers each client pulls from (DisPFL: 10 of 100).
        max_out_degree: optional cap on how many clients one node sends to per round.
        **kwargs: ``drop_prob``, ``drop_mode``.

    Example:
        >>> t = RandomPeers(k=2)
        >>> nb = t.neighbors(0, 3, range(6), seed=0)
        >>> len(nb), 3 in nb, nb == t.neighbors(0, 3, range(6), seed=0)
        (2, False, True)
    """

    def __init__(self, *, k: int = 10, max_out_degree: int | None = None, drop_prob: float = 0.0,
                 drop_mode: Literal["offline", "reference"] = "offline") -> None:
        super().__init__(drop_prob=drop_prob, drop_mode=drop_mode)
        check(isinstance(k, int) and k >= 1, "topology.k", k, "an int >= 1")
        check(max_out_degree is None or max_out_degree >= k, "topology.max_out_degree", max_out_degree,
              f"null or an int >= k ({k})")
        self.k = k
        self.max_out_degree = max_out_degree
        self._cache: tuple[int, int, int, dict[int, list[int]]] | None = None

    def graph(self, round_idx: int, num_clients: int, seed: int) -> dict[int, list[int]]:
        """All pull lists of a round (client -> the peers it receives from)."""
        if self._cache is not None and self._cache[:3] == (round_idx, num_clients, seed):
            return self._cache[3]
        check(self.k < num_clients, "topology.k", self.k, f"an int < the number of clients ({num_clients})")
        rng = _rng(seed, STREAM_IDS["peers"], round_idx)
        pulls: dict[int, list[int]] = {}
        if self.max_out_degree is None:
            for c in range(num_clients):
                others = np.delete(np.arange(num_clients), c)
                pulls[c] = sorted(int(j) for j in rng.choice(others, size=self.k, replace=False))
        else:
            load = np.zeros(num_clients, dtype=np.int64)
            for c in rng.permutation(num_clients):
                free = [j for j in range(num_clients) if j != c and load[j] < self.max_out_degree]
                if len(free) < self.k:  # the greedy order ran out of capacity: use a circulant graph instead
                    pulls = self._circulant(rng.permutation(num_clients))
                    break
                pick = rng.choice(np.asarray(free), size=self.k, replace=False)
                load[pick] += 1
                pulls[int(c)] = sorted(int(j) for j in pick)
        self._cache = (round_idx, num_clients, seed, pulls)
        return pulls

    def _circulant(self, order: np.ndarray) -> dict[int, list[int]]:
        """Client ``order[i]`` pulls from ``order[i+1 .. i+k]`` (mod K): every node serves exactly ``k`` clients."""
        n = len(order)
        return {int(order[i]): sorted(int(order[(i + d) % n]) for d in range(1, self.k + 1)) for i in range(n)}

    def _graph(self, round_idx: int, client_idx: int, clients: list[int], seed: int) -> list[int]:
        return list(self.graph(round_idx, len(clients), seed)[client_idx])
