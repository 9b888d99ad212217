"""The draft store of speculative rollouts (``rollout.speculative``; :mod:`megarl.rollout.speculative`).

Per prompt id (:attr:`megarl.tasks.PromptRecord.uid`), the responses that the prompt's last
generation sampled: token ids, the sampling policy's log-prob of each token and its top-k
log-probs at each position (int32 / float32 arrays: ``4 * R * (2 + 2k)`` bytes a response; the
quickstart's 64 prompts x 4 samples x ~60 tokens at k = 20 take ~2.6 MB). It lives on the
controller, next to the prompt order; a prompt's next epoch takes its drafts from here. Each
entry also keeps a hash of the prompt's token ids: a prompt whose tokens changed (another chat
template, an edited file) gets no draft.

Bounded: over ``rollout.draft_store_mb`` the least recently stored prompts are dropped (counted
in ``spec/store_evicted``; their next generation is plain). Saved with every checkpoint
(``drafts.pt`` in the step's folder, tensors only, loaded with ``weights_only=True``), so a run
resumed in the middle of an epoch verifies the same drafts as an uninterrupted one.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

FILE = "drafts.pt"
"""The store's file in a checkpoint folder."""
FIELDS = ("token_ids", "logprobs", "top_ids", "top_logprobs")


def prompt_key(prompt_ids) -> int:
    """A stable hash of a prompt's token ids (Python's hash of a tuple of ints is not salted)."""
    return hash(tuple(int(t) for t in prompt_ids))


def as_draft(sample: dict) -> dict:
    """The stored form of a sample (:func:`megarl.rollout.sampling.samples_of` with top-k)."""
    return {"token_ids": np.asarray(sample["token_ids"], np.int32),
            "logprobs": np.asarray(sample["logprobs"], np.float32),
            "top_ids": np.asarray(sample["top_ids"], np.int32),
            "top_logprobs": np.asarray(sample["top_logprobs"], np.float32),
            "clipped": bool(sample["clipped"])}


def nbytes(drafts: list[dict]) -> int:
    return sum(d[f].nbytes for d in drafts for f in FIELDS)


class DraftStore:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, tuple[int, list[dict]]] = OrderedDict()   # uid -> (prompt key, drafts)
        self._lock = threading.Lock()   # one_step_off generates in a thread while the controller saves
        self.bytes, self.evicted = 0, 0

    def __len__(self) -> int:
        return len(self._items)

    def get(self, uid: str | None, prompt_ids) -> list[dict] | None:
        """The drafts of prompt ``uid`` when its stored prompt has the same tokens; else None."""
        if uid is None:
            return None
        with self._lock:
            item = self._items.get(uid)
        return item[1] if item is not None and item[0] == prompt_key(prompt_ids) else None

    def put(self, uid: str | None, prompt_ids, samples: list[dict]) -> None:
        """Store ``samples`` (each with ``top_ids``/``top_logprobs``) as the drafts of ``uid``."""
        if uid is None or not samples or "top_ids" not in samples[0]:
            return
        drafts = [as_draft(s) for s in samples]
        with self._lock:
            old = self._items.pop(uid, None)
            if old is not None:
                self.bytes -= nbytes(old[1])
            self._items[uid] = (prompt_key(prompt_ids), drafts)
            self.bytes += nbytes(drafts)
            while self.bytes > self.max_bytes and len(self._items) > 1:
                _, (_, dropped) = self._items.popitem(last=False)
                self.bytes -= nbytes(dropped)
                self.evicted += 1

    def metrics(self) -> dict:
        return {"spec/store_mb": self.bytes / 2**20, "spec/store_prompts": len(self._items),
                "spec/store_evicted": self.evicted}

    # ------------------------------------------------------------------ checkpoints
    def save(self, folder: str | Path) -> None:
        """Write the store to ``folder/drafts.pt`` (tensors, numbers and strings only)."""
        import torch

        with self._lock:
            items = [[uid, key, [{**{f: torch.from_numpy(np.ascontiguousarray(d[f])) for f in FIELDS},
                                  "clipped": d["clipped"]} for d in drafts]]
                     for uid, (key, drafts) in self._items.items()]
        torch.save({"version": 1, "items": items, "evicted": self.evicted}, Path(folder) / FILE)

    def load(self, folder: str | Path, load_plain) -> bool:
        """Replace the store by ``folder/drafts.pt`` read with ``load_plain`` (the checkpoints'
        weights-only loader, :func:`megarl.checkpoint_files.load_plain`); False when the
        checkpoint has none."""
        path = Path(folder) / FILE
        if not path.is_file():
            return False
        state = load_plain(path)
        with self._lock:
            self._items.clear()
            self.bytes = 0
            for uid, key, drafts in state["items"]:
                ds = [{**{f: d[f].numpy() for f in FIELDS}, "clipped": bool(d["clipped"])} for d in drafts]
                self._items[uid] = (int(key), ds)
                self.bytes += nbytes(ds)
            self.evicted = int(state.get("evicted", 0))
        return True
