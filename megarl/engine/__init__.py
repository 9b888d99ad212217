"""Megatron policy engine: build from HF, packed log-probs, train step, reference, export, offload."""
from megarl.engine.build import BuiltModel, ModelOptions, build_model, check_layout
from megarl.engine.logprobs import SequenceBatch
from megarl.engine.policy import (LogprobOutput, OptimOptions, PolicyEngine, check_train_layout,
                                  reference_engine)

__all__ = ["BuiltModel", "LogprobOutput", "ModelOptions", "OptimOptions", "PolicyEngine", "SequenceBatch",
           "build_model", "check_layout", "check_train_layout", "reference_engine"]
