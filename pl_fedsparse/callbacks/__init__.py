"""Library callbacks: one file per technique. Each is usable by ``class_path: pl_fedsparse.callbacks.<Name>``."""

from pl_fedsparse.callbacks.base import POLICIES, FederatedCallback
from pl_fedsparse.callbacks.baselines import Ditto, FineTune, LocalTraining
from pl_fedsparse.callbacks.masking import MaskedTraining, SparseMask
from pl_fedsparse.callbacks.optimizer_state import KeepOptimizerState
from pl_fedsparse.callbacks.prune_regrow import GradientRegrow, MaskPruneRegrow, RandomRegrow
from pl_fedsparse.callbacks.fedspa import FedSpaAggregation
from pl_fedsparse.callbacks.gossip import Gossip
from pl_fedsparse.callbacks.dmpfl import DualMask, FedDST
from pl_fedsparse.callbacks.shift_eval import ShiftEvaluation
from pl_fedsparse.callbacks.adaptive_inference import AdaptiveInference
from pl_fedsparse.callbacks.fedpse import ElementwiseAggregation, PersonalizedDownstream, TopKUpload
from pl_fedsparse.callbacks.compression import SparseDownstream, StructuredUpload
from pl_fedsparse.callbacks.pfedgate import PFedGate
from pl_fedsparse.callbacks.novel_clients import NovelClients
from pl_fedsparse.callbacks.personal_layers import PersonalLayers
from pl_fedsparse.callbacks.fedem import FedEM

__all__ = ["FederatedCallback", "POLICIES", "LocalTraining", "FineTune", "SparseMask", "MaskedTraining", "KeepOptimizerState",
           "MaskPruneRegrow", "GradientRegrow", "RandomRegrow", "FedSpaAggregation", "Gossip",
           "ShiftEvaluation", "AdaptiveInference", "Ditto", "DualMask", "FedDST", "TopKUpload", "ElementwiseAggregation",
           "PersonalizedDownstream", "SparseDownstream", "StructuredUpload", "PFedGate",
           "NovelClients", "PersonalLayers", "FedEM"]
