"""Metrics sinks (stdout, JSONL, trackers: TensorBoard, wandb, mlflow), progress, phase timers, GPU stats and plots."""
from megarl.observability.gpu import gpu_stats
from megarl.observability.jsonl import read_jsonl
from megarl.observability.metrics import MetricsLogger, PhaseTimer

__all__ = ["MetricsLogger", "PhaseTimer", "gpu_stats", "read_jsonl"]
