"""CLI: see ``python conversion/megatron_to_hf.py --help`` (megarl.conversion.cli.megatron_to_hf_main).

Run with N processes: ``torchrun --nproc-per-node N conversion/megatron_to_hf.py ... --tp T --pp P --ep E``.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __name__ == "__main__":   # dist_checkpointing's writer spawns a Manager that re-imports __main__
    from megarl.conversion.cli import megatron_to_hf_main

    sys.exit(megatron_to_hf_main())
