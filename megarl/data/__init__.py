"""Data plane: DP balancing (Karmarkar-Karp + local search), token-budgeted micro-batches,
THD packing. ``plan_batches`` is the entry point; importing this package does not import torch
(packing and the process-group path import it when called)."""

from megarl.data.balance import (balance_partitions, branch_and_bound, flops_cost_coefficients,
                                 flops_cost_coefficients_from_config, imbalance, karmarkar_karp,
                                 refine_partitions, sequence_costs)
from megarl.data.microbatch import (micro_batches_all_ranks, micro_batches_this_rank,
                                    split_micro_batches)
from megarl.data.packing import (PackedSequences, gather_cp_shares, pack_sequences,
                                 packed_seq_params_kwargs, sequence_alignment, unpack_sequences)
from megarl.data.batching import BatchBudget, BatchPlan, plan_batches, restore_order

__all__ = [
    "BatchBudget", "BatchPlan", "PackedSequences", "balance_partitions", "branch_and_bound",
    "flops_cost_coefficients", "flops_cost_coefficients_from_config", "gather_cp_shares",
    "imbalance", "karmarkar_karp", "micro_batches_all_ranks", "micro_batches_this_rank",
    "pack_sequences", "packed_seq_params_kwargs", "plan_batches", "refine_partitions",
    "restore_order", "sequence_alignment", "sequence_costs", "split_micro_batches",
    "unpack_sequences",
]
