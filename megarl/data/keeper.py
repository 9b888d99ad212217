"""The owner of what a rollout engine puts into Ray's object store.

An object in Ray's store belongs to the process that put it, and dies with it: a restarted
engine would take the routing, token ids and log-probs of every sample it delivered with it, and
the step that trains on them could not fetch them (an async producer's buffered samples, a step
that trains while the engines generate the next one). So an engine does not own them: it hands
the arrays of each message to its :class:`Keeper`, a small actor next to it (same placement
bundle, so the same node; no CPU reserved, no torch) that puts them and returns the references.
The keeper outlives the engine's restarts; Ray's borrowing protocol keeps each object alive while
a handle to it does (the controller's sample, a rank's micro-batch) and frees it after. Only a lost
node takes a keeper's objects with it.

This module imports neither torch nor megarl's model code, so that a keeper starts in a second.
"""
from __future__ import annotations


class Keeper:
    """One per rollout engine slot (:class:`megarl.actors.placement.Placement`): puts arrays on
    behalf of the engine, and owns them."""

    def put(self, arrays: list) -> list:
        """Each array (numpy) into the object store, owned by this actor; their references."""
        import ray

        return [ray.put(a) for a in arrays]

    def object_refs(self) -> int:
        """What it put that someone still references (:func:`reference_count`)."""
        return reference_count()


def reference_count() -> int:
    """The object references this process holds or owns (Ray's reference table): what it put and
    is still referenced somewhere, and the handles it holds."""
    import ray

    return len(ray._private.worker.global_worker.core_worker.get_all_reference_counts())


def keeper_actor_class():
    """:class:`Keeper` as a Ray actor class (no CPU reserved: it only copies arrays in)."""
    import ray

    return ray.remote(num_cpus=0)(Keeper)
