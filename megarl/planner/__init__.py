"""``megarl plan``: memory and step time of a recipe without GPUs or weights.

:mod:`~megarl.planner.hardware` (GPU peaks, with sources), :mod:`~megarl.planner.flops` (model
FLOPs per token), :mod:`~megarl.planner.ranks` (each distinct rank's real model on the meta
device under a fake process group), :mod:`~megarl.planner.memory` (bytes per device and node),
:mod:`~megarl.planner.roofline` (step time) and :mod:`~megarl.planner.plan` (the report).
"""
