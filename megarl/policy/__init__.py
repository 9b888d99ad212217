"""The Megatron policy model: build from HF, packed log-probs, train step, reference, export, offload."""
from megarl.policy.build import BuiltModel, ModelOptions, build_model, check_layout
from megarl.policy.logprobs import LogprobOutput, SequenceBatch
from megarl.policy.model import PolicyModel, check_train_layout, reference_model
from megarl.policy.train import OptimOptions

__all__ = ["BuiltModel", "LogprobOutput", "ModelOptions", "OptimOptions", "PolicyModel", "SequenceBatch",
           "build_model", "check_layout", "check_train_layout", "reference_model"]
