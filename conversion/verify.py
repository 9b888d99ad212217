"""CLI: see ``python conversion/verify.py --help`` (megarl.conversion.cli.verify_main).

Run with N processes: ``torchrun --nproc-per-node N conversion/verify.py ... --tp T --pp P --ep E``.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __name__ == "__main__":   # dist_checkpointing's writer spawns a Manager that re-imports __main__
    from megarl.conversion.cli import verify_main

    sys.exit(verify_main())
