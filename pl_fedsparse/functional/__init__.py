"""Pure tensor maths: tensors in, tensors out, no Lightning imports, no hidden state."""

from pl_fedsparse.functional.aggregation import masked_weighted_average, weighted_average
from pl_fedsparse.functional.accounting import message_nbytes, sparse_nbytes, tensor_nbytes
from pl_fedsparse.functional.masks import apply_masks, check_density, random_mask, uniform_densities

__all__ = [
    "masked_weighted_average", "weighted_average", "message_nbytes", "sparse_nbytes", "tensor_nbytes",
    "apply_masks", "check_density", "random_mask", "uniform_densities",
]
