"""CLI: see ``python conversion/hf_to_megatron.py --help`` (megarl.conversion.cli.hf_to_megatron_main).

Run with N processes: ``torchrun --nproc-per-node N conversion/hf_to_megatron.py ... --tp T --pp P --ep E``.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __name__ == "__main__":   # dist_checkpointing's writer spawns a Manager that re-imports __main__
    from megarl.conversion.cli import hf_to_megatron_main

    sys.exit(hf_to_megatron_main())
