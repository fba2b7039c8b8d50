"""A natural partition (``data.partition: natural``): one client per id in the data's own per-sample client ids
(``train_client`` / ``test_client`` of a :class:`~pl_fedsparse.data.base.BaseDataset`: LEAF users, a ``.npz``'s
``client`` array), client indices in sorted id order."""

from __future__ import annotations

import numpy as np

from pl_fedsparse.data.base import BaseDataset
from pl_fedsparse.errors import ConfigError

__all__ = ["client_groups", "natural_clients"]


def natural_clients(base: BaseDataset, num_clients: int | None, test_mode: str, pooled: bool, label: str
                    ) -> tuple[np.ndarray, np.ndarray | None, int, list]:
    """The client index (0-based, by sorted id) of every train sample (``pooled``: train then test) and of every test
    sample (``None`` without ``test_client``), the number of clients, and the data's own id of each client index.

    Args:
        base: the base dataset, with ``train_client`` (and optionally ``test_client``) ids.
        num_clients: ``data.num_clients``; ``None`` takes the number of distinct ids, another value must equal it.
        test_mode: ``data.test_mode`` (``partition`` and ``pooled`` need ``test_client`` ids).
        pooled: whether the train and test samples are pooled (train first).
        label: how messages name the data (``data.name=...``).

    Raises:
        ConfigError: no client ids, a ``num_clients`` that is not the number of ids, a test id without training
            samples, or a test mode that needs test ids the data does not have.
    """
    if base.train_client is None:
        raise ConfigError(f"data.partition='natural' is invalid: expected per-sample client ids (train_client) "
                          f"from {label}, which has none; use a synthetic scheme such as 'dirichlet'")
    ids = base.train_client.cpu().numpy()
    uniq = np.unique(ids)
    if num_clients is None:
        num_clients = len(uniq)
    elif num_clients != len(uniq):
        raise ConfigError(f"data.num_clients={num_clients} is invalid: expected {len(uniq)} (the number "
                          f"of distinct client ids of {label}) or null with data.partition='natural'")
    train_c = np.searchsorted(uniq, ids)
    test_c = None
    if base.test_client is not None:
        tids = base.test_client.cpu().numpy()
        known = np.isin(tids, uniq)
        if not known.all():
            raise ConfigError(f"data.partition='natural' is invalid: {label} has test_client id "
                              f"{int(tids[~known][0])} without training samples; expected every test client id "
                              f"among the train_client ids")
        test_c = np.searchsorted(uniq, tids)
    elif test_mode in ("partition", "pooled"):
        raise ConfigError(f"data.test_mode={test_mode!r} is invalid: expected 'split' or 'global' with "
                          f"data.partition='natural' when {label} has no test_client ids")
    if pooled:
        assert test_c is not None
        train_c = np.concatenate([train_c, test_c])
    return train_c, test_c, num_clients, uniq.tolist()


def client_groups(client_of: np.ndarray, num_clients: int) -> list[np.ndarray]:
    """Sorted positions of every client's samples (``client_of``: one client index per position)."""
    order = np.argsort(client_of, kind="stable")
    cuts = np.searchsorted(client_of[order], np.arange(1, num_clients))
    return [np.sort(part) for part in np.split(order, cuts)]
