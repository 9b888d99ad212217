"""Sample payloads in Ray's object store: the controller holds references, the ranks fetch the bytes.

This module owns the handles (:class:`Stored`, :class:`Rows`, :class:`Column`), the producer's
side (:class:`Outbox`, :func:`claim`) and the ranks' side (:func:`fetch_batches`). Two kinds of
payload travel this way: a sample's routed experts, token ids and vLLM log-probs (:data:`PAYLOADS`),
put by the engine that made them; and the forward passes before an update (old and reference
log-probs, the rollout correction's weights and kept tokens), put by the training ranks
(:func:`put_rows`). The controller carries handles and metadata, never the bytes.

Choices: a producer never streams an object reference, it streams :class:`Pending` keys and the
controller claims the handles with an ordinary actor call (ray-project/ray#58080; see
:class:`Outbox`). Lifetime is Ray's reference counting: an object lives while a handle to it does,
so a step's objects are freed once the step is done with them and nothing is kept across steps.
An engine's objects are owned by its :class:`megarl.data.keeper.Keeper`, which outlives the
engine's restarts; a fetch of an object whose owner died fails with :class:`RoutingLost`.
"""
from __future__ import annotations

import numpy as np
import torch

from megarl.data.keeper import reference_count


def digest(ids) -> bytes:
    """A response's identity without its tokens: 16 bytes of BLAKE2b over its ids as int32
    (what an engine sends for ``rollout/distinct_frac``; the controller hashes the ids it holds
    the same way)."""
    import hashlib

    return hashlib.blake2b(np.asarray(ids, np.int32).tobytes(), digest_size=16).digest()


class RoutingLost(RuntimeError):
    """A stored payload could not be fetched: the process that owned it (a rollout engine's
    keeper, a training rank) is gone."""


def _as_array(array) -> tuple[np.ndarray, str]:
    """``array`` (numpy or torch) as the numpy array the object store holds, and its dtype's name
    (numpy has no bfloat16: a bf16 tensor's bits, as int16, named ``bfloat16``)."""
    if isinstance(array, torch.Tensor) and array.dtype == torch.bfloat16:
        return array.detach().cpu().contiguous().view(torch.int16).numpy(), "bfloat16"
    a = array.detach().cpu().numpy() if isinstance(array, torch.Tensor) else np.asarray(array)
    return a, str(a.dtype)


class Stored:
    """A handle on an array in Ray's object store: the reference, the array's shape and dtype
    (what the controller reads: e.g. a routing's row count), and its size in bytes.

    A sample's routed experts (rollout routing replay: ``[P + R, Lm, K]`` int16, Lm x K x 2 bytes
    a token: 928 B for DeepSeek-V3, by far the largest per-token payload of a step) travel so::

        vLLM engine actor --ray.put--> object store (node of the engine)
        controller: Rollout.routed_experts = [Stored(ref, shape, dtype)]  (metadata only)
        training rank: SequenceBatch.routing = [Stored] --fetch_batches--> tensors (one ray.get)
        old log-prob pass (r2): the ranks put the routing they recorded; the controller passes the
        handles on to the update."""

    __slots__ = ("ref", "shape", "dtype", "nbytes")

    def __init__(self, ref, shape: tuple, dtype: str, nbytes: int):
        self.ref, self.shape, self.dtype, self.nbytes = ref, tuple(shape), dtype, int(nbytes)

    @classmethod
    def put(cls, array) -> "Stored":
        """``array`` (numpy or torch) into the object store, owned by the calling process."""
        import ray

        a, dtype = _as_array(array)
        return cls(ray.put(a), a.shape, dtype, a.nbytes)

    def __reduce__(self):   # __slots__ without __dict__: pickle by the constructor's arguments
        return Stored, (self.ref, self.shape, self.dtype, self.nbytes)

    def numel(self) -> int:
        """The array's element count (as a tensor's: a micro-batch checks its sequences' sizes on
        the controller before the rank fetches them)."""
        return int(np.prod(self.shape, dtype=np.int64))

    def dim(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        return f"Stored({self.dtype}{list(self.shape)}, {self.nbytes} B)"


class Pending:
    """What a producer streams in place of a :class:`Stored`: the key of the object in its
    :class:`Outbox`, with the array's shape, dtype and size (no reference)."""

    __slots__ = ("key", "shape", "dtype", "nbytes")

    def __init__(self, key: int, shape: tuple, dtype: str, nbytes: int):
        self.key, self.shape, self.dtype, self.nbytes = key, tuple(shape), dtype, int(nbytes)

    def __reduce__(self):
        return Pending, (self.key, self.shape, self.dtype, self.nbytes)

    def __repr__(self) -> str:
        return f"Pending(#{self.key} {self.dtype}{list(self.shape)})"


class Outbox:
    """A producer's arrays until the controller's :func:`claim`: :meth:`put` keeps the array and
    answers a :class:`Pending` key; :meth:`take` puts the claimed ones into the object store, in
    one call to the producer's ``keeper`` (:class:`megarl.data.keeper.Keeper`, which then owns
    them and outlives the producer's restarts) or, without one, by this process (which owns them),
    and hands the :class:`Stored` handles over. Thread-safe: the producer puts from its generating
    thread (no Ray call there), the claim takes from the control thread.

    Why an outbox: the engines answer through Ray streaming generators, and an object reference
    nested in a streamed item can lose its reference count: the owner frees the object while the
    controller still holds the handle, and the rank's fetch fails with
    ``ReferenceCountingAssertionError`` (ray-project/ray#58080, open at Ray 2.56; reproduced here on
    a 16x data-plane batch). So a producer streams :class:`Pending` keys, the controller claims the
    handles with an ordinary actor call, and Ray's borrowing protocol for returned references
    takes over. An object dies with its owner, hence the keeper: an engine restarted while its
    samples wait in an async buffer, or while a step trains on them, loses nothing."""

    def __init__(self, keeper=None):
        import threading

        self.keeper = keeper
        self._held: dict = {}
        self._lock = threading.Lock()
        self._next = 0

    def put(self, array) -> Pending:
        """Keep ``array`` (numpy or torch; not to be changed afterwards) for a claim."""
        a, dtype = _as_array(array)
        with self._lock:
            self._next += 1
            self._held[self._next] = (a, dtype)
            return Pending(self._next, a.shape, dtype, a.nbytes)

    def take(self, keys: list) -> list:
        """The :class:`Stored` handles of ``keys``, put into the object store by this call and
        dropped from this outbox (a key not held: None)."""
        import ray

        with self._lock:
            held = [self._held.pop(k, None) for k in keys]
        arrays = [h[0] for h in held if h is not None]
        if not arrays:
            return [None] * len(keys)
        refs = iter(ray.get(self.keeper.put.remote(arrays)) if self.keeper is not None else
                    [ray.put(a) for a in arrays])
        return [None if h is None else Stored(next(refs), h[0].shape, h[1], h[0].nbytes) for h in held]

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def object_refs(self) -> int:
        """The object references that what this outbox put keeps alive: its keeper's, or without
        one this process's (:func:`reference_count`)."""
        import ray

        return ray.get(self.keeper.object_refs.remote()) if self.keeper is not None else reference_count()


PAYLOADS = ("routed_experts", "stored_ids", "stored_logprobs")
"""The sample fields an engine may put into the object store (:func:`claim` takes them all): the
routing, and the sequence's token ids (prompt + response, int32) and vLLM's log-probs (float64)
for the training ranks (:meth:`megarl.rollout.stash.Stash.put_pairs`). The micro-batches carry
the handles, the ranks resolve them (:func:`fetch_batches`, the log-probs as :class:`Rows` of a
:class:`Column`). The controller keeps no copy of the ids or log-probs: the engine sends the
sample's metadata instead (its response length, the response decoded for the rewards, and a
:func:`digest` of its ids for ``rollout/distinct_frac``); the controller's few readers of the ids
themselves (a reward model's inputs, the generations log's samples) fetch them
(:meth:`megarl.data.batch.Rollout.responses`). Speculative rollouts (their drafts are the
samples), an async sample resumed across a sync (the producer joins its parts) and the agent loop
(it joins the turns) keep their copies."""


def claim(actor, samples, fields: tuple = PAYLOADS) -> None:
    """Replace each sample's :class:`Pending` ``fields`` by their :class:`Stored` handles, taken
    from ``actor``'s :class:`Outbox` by one ordinary call (``actor.take_stored(keys)``) and waited for:
    one call per message that has any, as each message arrives; ``take_stored`` is a method of the
    engine's control thread, so it runs while the stream does."""
    import ray

    pending = [(s, f) for s in samples for f in fields if isinstance(s.get(f), Pending)]
    if not pending:
        return
    got = ray.get(actor.take_stored.remote([s[f].key for s, f in pending]))
    for (s, f), stored in zip(pending, got):
        if stored is None:
            raise RoutingLost(f"the producer no longer holds {s[f]!r} (claimed twice, or the actor restarted)")
        s[f] = stored


def put_all(arrays: list) -> list:
    """Each array as a :class:`Stored` (None stays None)."""
    return [None if a is None else Stored.put(a) for a in arrays]


def fetch(items: list) -> list:
    """``items`` with every :class:`Stored` replaced by its tensor (one ``ray.get`` for all of
    them); anything else is returned as a tensor too (``torch.as_tensor``), None as None.

    Within a node a fetch maps the shared-memory object (no copy through the controller); across
    nodes Ray moves the bytes from the producing node. An object whose owner died raises
    :class:`RoutingLost`."""
    import ray

    where = [i for i, x in enumerate(items) if isinstance(x, Stored)]
    out = [None if x is None else x if isinstance(x, Stored) else torch.as_tensor(x) for x in items]
    if not where:
        return out
    try:
        arrays = ray.get([items[i].ref for i in where])
    except (ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError) as err:
        raise RoutingLost(
            f"a sample's stored payload is no longer in Ray's object store ({type(err).__name__}): the process that "
            "owned it (a rollout engine's keeper for a sample's token ids, log-probs or routed experts, lost with its "
            "node; a training rank for recorded routing or a forward pass's log-probs) has died since; the step cannot "
            "use it. Resume from the last checkpoint") \
            from err
    for i, a in zip(where, arrays):
        out[i] = _tensor(a, items[i].dtype)
    return out


def _tensor(array, dtype: str) -> torch.Tensor:
    t = torch.from_numpy(np.array(array))   # object-store arrays are read-only: a private copy
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t


class Rows:
    """A sample's part of a packed per-token tensor in the object store: rows ``start:stop`` of a
    :class:`Stored` (one object per micro-batch of a forward pass, every sample of it a
    :class:`Rows`; the update's micro-batches regroup the samples, see :class:`Column`)."""

    __slots__ = ("stored", "start", "stop")

    def __init__(self, stored: Stored, start: int, stop: int):
        self.stored, self.start, self.stop = stored, int(start), int(stop)

    def __reduce__(self):
        return Rows, (self.stored, self.start, self.stop)

    def __len__(self) -> int:
        return self.stop - self.start

    def __repr__(self) -> str:
        return f"Rows({self.start}:{self.stop} of {self.stored!r})"


class Column:
    """One packed ``extras`` entry of a micro-batch that the rank assembles (:func:`fetch_batches`):
    its samples' :class:`Rows`, concatenated, and with ``and_mask`` (a bool ``[R]``) ANDed in
    (the loss mask of a corrected ``mask_T``)."""

    __slots__ = ("rows", "and_mask")

    def __init__(self, rows: list, and_mask: torch.Tensor | None = None):
        self.rows, self.and_mask = list(rows), and_mask

    def __reduce__(self):
        return Column, (self.rows, self.and_mask)


def put_rows(packed: torch.Tensor, sizes: list[int]) -> list[Rows]:
    """``packed`` (``[sum(sizes)]``, any dtype) into the object store as one object, owned by the
    calling process; one :class:`Rows` per part of ``sizes``.

    The training ranks' DP leaders put each forward pass before an update this way, one object per
    micro-batch; they own what they put (a rank that dies fails the step anyway)."""
    stored, out, start = Stored.put(packed), [], 0
    for n in sizes:
        out.append(Rows(stored, start, start + n))
        start += n
    return out


def fetch_rows(rows: list) -> list[torch.Tensor]:
    """Each :class:`Rows` as a tensor (one ``ray.get`` for the distinct objects; a tensor passes)."""
    objects = {id(r.stored): r.stored for r in rows if isinstance(r, Rows)}
    got = dict(zip(objects, fetch(list(objects.values()))))
    return [got[id(r.stored)][r.start:r.stop] if isinstance(r, Rows) else r for r in rows]


def fetch_batches(micro_batches: list) -> None:
    """Resolve in place everything the micro-batches carry by reference, with one ``ray.get`` of
    the distinct objects: the token ids (an engine's ``stored_ids``, int32 prompt + response), the
    routing (:class:`Stored` in ``routing``) and every :class:`Column` of the ``extras``. A
    per-sequence list with any handle comes back as tensors (``torch.as_tensor``; None stays None)."""
    objects: dict = {}   # id -> Stored: each object fetched once, however many rows or batches read it

    def note(x) -> None:
        if isinstance(x, Stored):
            objects.setdefault(id(x), x)

    lists = [attr for attr in PER_SEQUENCE if any(isinstance(x, Stored) for mb in micro_batches
                                                  for x in getattr(mb, attr) or ())]
    for mb in micro_batches:
        for attr in lists:
            for x in getattr(mb, attr) or ():
                note(x)
        for v in mb.extras.values():
            if isinstance(v, Column):
                for r in v.rows:
                    note(r.stored if isinstance(r, Rows) else None)
    got = dict(zip(objects, fetch(list(objects.values())))) if objects else {}

    def as_tensor(x):
        return got[id(x)] if isinstance(x, Stored) else None if x is None else torch.as_tensor(x)

    def row(r):
        return got[id(r.stored)][r.start:r.stop] if isinstance(r, Rows) else r

    for mb in micro_batches:
        for attr in lists:
            xs = getattr(mb, attr)
            if xs is not None:
                setattr(mb, attr, [as_tensor(x) for x in xs])
        for k, v in list(mb.extras.items()):
            if isinstance(v, Column):
                t = torch.cat([row(r) for r in v.rows])
                mb.extras[k] = t & v.and_mask if v.and_mask is not None else t


PER_SEQUENCE = ("input_ids", "routing")
"""The micro-batch's per-sequence lists that may hold :class:`Stored` handles (:func:`fetch_batches`)."""


def stored_bytes(items: list) -> int:
    """Bytes of the :class:`Stored` handles in ``items`` (what stays off the controller)."""
    return sum(x.nbytes for x in items if isinstance(x, Stored))


__all__ = ["Stored", "Pending", "Outbox", "PAYLOADS", "claim", "RoutingLost", "put_all", "fetch", "fetch_batches",
           "reference_count", "stored_bytes", "Rows", "Column", "put_rows", "fetch_rows"]
