"""Megatron policy engine: build from HF, packed log-probs, train step, reference, export, offload."""
from megarl.engine.build import BuiltModel, ModelOptions, build_model, check_layout
from megarl.engine.logprobs import LogprobOutput, SequenceBatch
from megarl.engine.policy import PolicyEngine, check_train_layout, reference_engine
from megarl.engine.train import OptimOptions

__all__ = ["BuiltModel", "LogprobOutput", "ModelOptions", "OptimOptions", "PolicyEngine", "SequenceBatch",
           "build_model", "check_layout", "check_train_layout", "reference_engine"]
