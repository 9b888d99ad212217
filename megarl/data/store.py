"""Sample payloads in Ray's object store: the controller holds references, the ranks fetch the bytes.

With ``trainer.data_plane: object_store`` (the default) a sample's routed experts (rollout routing
replay: ``[P + R, Lm, K]`` int16, Lm x K x 2 bytes a token: 928 B for DeepSeek-V3, by far the
largest per-token payload of a step) are put into the object store by the process that made them
and travel as :class:`Stored` handles:

    vLLM engine actor --ray.put--> object store (node of the engine)
    controller: Rollout.routed_experts = [Stored(ref, shape, dtype)]  (metadata only)
    training rank: SequenceBatch.routing = [Stored] --fetch_routing--> tensors (one ray.get)
    old log-prob pass (r2): the ranks put the routing they recorded; the controller passes the
    handles on to the update.

Within a node a fetch maps the shared-memory object (no copy through the controller); across
nodes Ray moves the bytes from the producing node. Lifetime is Ray's reference counting: an
object lives while a handle to it does (the step's :class:`~megarl.trainer.batch.Rollout`, an
asynchronous source's queued groups), so a step's objects are freed once the step is done with
them; nothing is kept across steps. An object's owner is the process that put it: a vLLM engine
that dies takes the routing it produced with it, and a fetch then fails with
:class:`RoutingLost`, naming what to do.

``trainer.data_plane: controller`` keeps the previous behaviour (arrays inline in the samples,
through the controller): the baseline of ``perf/bench_dataplane.py``.
"""
from __future__ import annotations

import numpy as np
import torch


class RoutingLost(RuntimeError):
    """A stored payload could not be fetched: the process that owned it (a rollout engine, a
    training rank) is gone."""


class Stored:
    """A handle on an array in Ray's object store: the reference, the array's shape and dtype
    (what the controller reads: e.g. a routing's row count), and its size in bytes."""

    __slots__ = ("ref", "shape", "dtype", "nbytes")

    def __init__(self, ref, shape: tuple, dtype: str, nbytes: int):
        self.ref, self.shape, self.dtype, self.nbytes = ref, tuple(shape), dtype, int(nbytes)

    @classmethod
    def put(cls, array) -> "Stored":
        """``array`` (numpy or torch) into the object store, owned by the calling process."""
        import ray

        a = array.numpy() if isinstance(array, torch.Tensor) else np.asarray(array)
        return cls(ray.put(a), a.shape, str(a.dtype), a.nbytes)

    def __reduce__(self):   # __slots__ without __dict__: pickle by the constructor's arguments
        return Stored, (self.ref, self.shape, self.dtype, self.nbytes)

    def __repr__(self) -> str:
        return f"Stored({self.dtype}{list(self.shape)}, {self.nbytes} B)"


def put_all(arrays: list) -> list:
    """Each array as a :class:`Stored` (None stays None)."""
    return [None if a is None else Stored.put(a) for a in arrays]


def fetch(items: list) -> list:
    """``items`` with every :class:`Stored` replaced by its tensor (one ``ray.get`` for all of
    them); anything else is returned as a tensor too (``torch.as_tensor``), None as None."""
    import ray

    where = [i for i, x in enumerate(items) if isinstance(x, Stored)]
    out = [None if x is None else x if isinstance(x, Stored) else torch.as_tensor(x) for x in items]
    if not where:
        return out
    try:
        arrays = ray.get([items[i].ref for i in where])
    except (ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError) as err:
        raise RoutingLost(
            f"a sample's routed experts are no longer in Ray's object store ({type(err).__name__}): the process that "
            "produced them (a rollout engine, or a training rank for recorded routing) has died since; the step cannot "
            "replay their routing. Resume from the last checkpoint, or run with trainer.data_plane=controller to keep "
            "routing on the controller") from err
    for i, a in zip(where, arrays):
        out[i] = torch.from_numpy(np.array(a))   # object-store arrays are read-only: a private copy
    return out


def fetch_routing(micro_batches: list) -> None:
    """Resolve the stored routing of every micro-batch in place (one ``ray.get``)."""
    flat = [r for mb in micro_batches if mb.routing is not None for r in mb.routing]
    if not any(isinstance(r, Stored) for r in flat):
        return
    got = iter(fetch(flat))
    for mb in micro_batches:
        if mb.routing is not None:
            mb.routing = [next(got) for _ in mb.routing]


def stored_bytes(items: list) -> int:
    """Bytes of the :class:`Stored` handles in ``items`` (what stays off the controller)."""
    return sum(x.nbytes for x in items if isinstance(x, Stored))


__all__ = ["Stored", "RoutingLost", "put_all", "fetch", "fetch_routing", "stored_bytes"]
