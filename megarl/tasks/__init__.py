"""Prompt datasets (parquet/jsonl, validated) and the built-in offline tasks: arithmetic and
calculator word problems (for the agent loop)."""

from megarl.tasks.arithmetic import LEVELS, generate_arithmetic
from megarl.tasks.dataset import REQUIRED_COLUMNS, PromptRecord, load_prompt_dataset, save_prompt_dataset

GENERATED_TASKS = ("arithmetic", "calculator")
"""``data.task`` values generated offline (no prompt file)."""

__all__ = ["GENERATED_TASKS", "LEVELS", "REQUIRED_COLUMNS", "PromptRecord", "generate_arithmetic", "load_prompt_dataset", "save_prompt_dataset"]
