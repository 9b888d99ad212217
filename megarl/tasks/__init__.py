"""Prompt datasets (parquet/jsonl, validated) and the built-in offline arithmetic task."""

from megarl.tasks.arithmetic import LEVELS, generate_arithmetic
from megarl.tasks.dataset import REQUIRED_COLUMNS, PromptRecord, load_prompt_dataset, save_prompt_dataset

__all__ = ["LEVELS", "REQUIRED_COLUMNS", "PromptRecord", "generate_arithmetic", "load_prompt_dataset", "save_prompt_dataset"]
