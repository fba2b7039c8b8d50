"""Data: base datasets, client partitions, fast in-memory loaders, shifted test sets and the federated datamodule.

Typical use::

    dm = FederatedDataModule("synthetic", num_clients=10, partition="dirichlet", alpha=0.3)
    dm.setup()
    for x, y in dm.train_loader(client_idx=0, seed=0):
        ...

Your own data: a built-in source (``data.name``: ``image_folder``, ``tensors``, ``torchvision``, ``leaf``; see
:mod:`pl_fedsparse.data.sources`), or a subclass of :class:`FederatedDataModule` overriding
:meth:`FederatedDataModule.load_base_dataset` to return a :class:`BaseDataset`.
"""

from pl_fedsparse.data.base import BaseDataset, channel_stats, input_kind
from pl_fedsparse.data.datamodule import FederatedDataModule
from pl_fedsparse.data.datasets import DATASETS, clear_memo, load_dataset
from pl_fedsparse.data.decode import read_idx
from pl_fedsparse.data.loaders import TensorBatchLoader, dataset_loader, normalize
from pl_fedsparse.data.partition import (
    SCHEMES,
    client_test_from_global,
    dirichlet,
    fedem_client_split,
    fedem_dirichlet,
    iid,
    noniid_ratio,
    partition,
    pathological,
    shards,
)
from pl_fedsparse.data.shift import shifted_test_indices, shifted_test_split
from pl_fedsparse.data.sources.idx import EMNIST_SPLITS
from pl_fedsparse.data.sources.synthetic import SYNTHETIC_DEFAULTS, make_synthetic
from pl_fedsparse.data.validate import validate_base_dataset

__all__ = [
    "BaseDataset",
    "DATASETS",
    "EMNIST_SPLITS",
    "SYNTHETIC_DEFAULTS",
    "FederatedDataModule",
    "SCHEMES",
    "TensorBatchLoader",
    "channel_stats",
    "clear_memo",
    "client_test_from_global",
    "dataset_loader",
    "dirichlet",
    "fedem_client_split",
    "fedem_dirichlet",
    "iid",
    "input_kind",
    "load_dataset",
    "make_synthetic",
    "noniid_ratio",
    "normalize",
    "partition",
    "pathological",
    "read_idx",
    "shards",
    "shifted_test_indices",
    "shifted_test_split",
    "validate_base_dataset",
]
