"""Your own data as a base dataset: an image folder, a file of tensors, any torchvision dataset, LEAF's JSON files.

Each source is chosen by ``data.name`` and read from ``data.root``; the result is a
:class:`~pl_fedsparse.data.datasets.BaseDataset` like the built-in datasets' (memoised per process, decoded files
cached on disk, see :mod:`pl_fedsparse.data.datasets`).

* ``image_folder`` — ``root/train/<class>/*.jpg|png`` and ``root/test/<class>/...`` (possibly one folder further down)
  with any number of classes, or a single ``root/<class>/...`` folder that is split into train and test per class
  (``data.test_fraction`` of each class is held out, seeded by ``data.seed``). The sorted class folder names are the
  labels ``0 .. C-1``; images are decoded as RGB ``uint8`` and must have one size unless ``data.image_size`` resizes
  them. The normalisation statistics are computed from the training images.
* ``tensors`` — ``root`` is a ``.pt`` file (read with ``torch.load(..., weights_only=True)``: tensors only, no code
  is ever run) or an ``.npz`` file (``np.load(..., allow_pickle=False)``) holding ``train_x``, ``train_y``,
  ``test_x``, ``test_y`` (or ``x``, ``y``, split like a single image folder by ``data.test_fraction``, per client
  when client ids are given), and optionally ``train_client``/``test_client`` (or ``client``) per-sample client ids
  for ``data.partition=natural``, ``num_classes`` (default: the largest label + 1) and ``mean``/``std``. Inputs may
  be ``uint8 [N, C, H, W]`` images, float features of any shape (stored as float32) or integer token ids (int64).
* ``torchvision`` — ``data.torchvision_class`` names a class of ``torchvision.datasets`` (``SVHN``, ``KMNIST``,
  ``QMNIST``, ``STL10``, ``USPS``, ...; or the dotted path of any class with torchvision's constructor) built as
  ``cls(root, train=...|split="train"/"test", download=data.download, **data.torchvision_args)`` into ``root``
  (default ``$PL_FEDSPARSE_CACHE/torchvision/<class>``); the images are converted once to ``uint8 [N, C, H, W]`` and
  cached. Without network the download fails in one line (:class:`~pl_fedsparse.errors.DataNotFoundError`).
* ``leaf`` — LEAF's per-user JSON files (``root/train/*.json`` and ``root/test/*.json``, each
  ``{"users": [...], "user_data": {user: {"x": [...], "y": [...]}}}``, as ``preprocess.sh`` writes them for FEMNIST,
  Shakespeare, Sent140's ids, ...). Every user is a natural client (in order of first appearance in the sorted train
  files). Numeric ``x`` is kept as given (floats → float32 features, e.g. FEMNIST's ``[N, 784]``; ints → int64 token
  ids); strings (Shakespeare) become character ids in LEAF's 80-letter alphabet, and so do string labels.

Example:
    >>> import os, tempfile
    >>> import numpy as np
    >>> path = os.path.join(tempfile.mkdtemp(), "toy.npz")
    >>> rng = np.random.default_rng(0)
    >>> np.savez(path, x=rng.standard_normal((40, 20)).astype(np.float32), y=np.arange(40) % 2,
    ...          client=np.arange(40) % 4)
    >>> d = load_source("tensors", path, False, test_fraction=0.25, seed=0)
    >>> d.kind, d.sample_shape, len(d.train_y), len(d.test_y), d.num_classes, sorted(set(d.train_client.tolist()))
    ('features', (20,), 32, 8, 2, [0, 1, 2, 3])
"""

from pl_fedsparse.data.sources._common import held_out_split, image_size_pair  # noqa: F401
from pl_fedsparse.data.sources.leaf import LEAF_LETTERS  # noqa: F401
from pl_fedsparse.data.sources.registry import USER_SOURCES, load_source, source_key
from pl_fedsparse.data.sources.tensor_file import TENSOR_KEYS  # noqa: F401
from pl_fedsparse.data.sources.torchvision_class import resolve_torchvision_class  # noqa: F401
from pl_fedsparse.data.validate import validate_base_dataset  # noqa: F401

__all__ = ["LEAF_LETTERS", "TENSOR_KEYS", "USER_SOURCES", "held_out_split", "image_size_pair", "load_source",
           "resolve_torchvision_class", "source_key", "validate_base_dataset"]
