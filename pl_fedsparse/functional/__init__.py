"""Pure tensor maths: tensors in, tensors out, no Lightning imports, no hidden state."""

from pl_fedsparse.functional.aggregation import masked_weighted_average, weighted_average
from pl_fedsparse.functional.accounting import message_nbytes, sparse_nbytes, tensor_nbytes, ternary_nbytes
from pl_fedsparse.functional.compression import structured_mask, ternarize
from pl_fedsparse.functional.inference import adaptive_choice, entropy, output_cosine
from pl_fedsparse.functional.masks import (
    apply_masks, check_density, erk_densities, layer_densities, mask_density, masks_from_densities,
    permutation_scores, random_mask, sorted_top_k, stable_top_k, topk_mask, uniform_densities,
)
from pl_fedsparse.functional.pse import (
    correlation_distance, elementwise_average, error_feedback_topk, personalized_mask, topk_sparsify,
)
from pl_fedsparse.functional.sparse import (
    cosine_prune_rate, drop_and_grow, drop_and_grow_many, pack_mask, pack_masks, prune_regrow_count, prune_regrow_counts, unpack_mask,
    unpack_masks,
)

__all__ = [
    "masked_weighted_average", "weighted_average", "message_nbytes", "sparse_nbytes", "tensor_nbytes",
    "apply_masks", "check_density", "topk_mask", "stable_top_k", "sorted_top_k", "permutation_scores", "random_mask", "uniform_densities",
    "erk_densities", "layer_densities", "masks_from_densities", "mask_density",
    "cosine_prune_rate", "prune_regrow_count", "prune_regrow_counts", "drop_and_grow", "drop_and_grow_many", "pack_mask", "unpack_mask", "pack_masks",
    "unpack_masks", "adaptive_choice", "entropy", "output_cosine",
    "topk_sparsify", "error_feedback_topk", "elementwise_average", "correlation_distance", "personalized_mask",
    "ternary_nbytes", "ternarize", "structured_mask",
]
