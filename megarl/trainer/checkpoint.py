"""Atomic, keep-last-k checkpoint folders.

Layout under ``root``::

    step_00000003/          a complete checkpoint (has COMPLETE with its metadata)
    .partial-step_00000004-<pid>/   being written; never read, removed on the next start

A checkpoint is written into a ``.partial-*`` folder, its ``COMPLETE`` marker is written and
fsync'ed last, and only then is the folder renamed to ``step_N`` (a rename within one file system
is atomic). A crash at any point before the rename leaves the previous checkpoints untouched and
readable; ``latest()`` only ever returns folders with the marker. Old checkpoints are pruned only
after the new one is complete.

In a multi-process job every rank writes its shards into the same partial folder (the caller
passes ``partial_dir()`` to megatron's ``dist_checkpointing.save``), then rank 0 alone calls
``commit()`` after a barrier.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

_STEP_RE = re.compile(r"^step_(\d{8})$")
MARKER = "COMPLETE"


def _fsync_dir(path: Path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointManager:
    def __init__(self, root: str | os.PathLike, keep_last: int = 2):
        if keep_last < 1:
            raise ValueError(f"checkpoint.keep_last={keep_last!r}: expected an integer >= 1")
        self.root = Path(root)
        self.keep_last = keep_last

    # -- reading ---------------------------------------------------------------------------
    def complete(self) -> list[tuple[int, Path]]:
        """(step, folder) of every complete checkpoint, oldest first."""
        if not self.root.is_dir():
            return []
        out = []
        for child in self.root.iterdir():
            match = _STEP_RE.match(child.name)
            if match and (child / MARKER).is_file():
                out.append((int(match.group(1)), child))
        return sorted(out)

    def latest(self) -> tuple[int, Path] | None:
        done = self.complete()
        return done[-1] if done else None

    def metadata(self, folder: Path) -> dict:
        return json.loads((Path(folder) / MARKER).read_text())

    # -- writing ---------------------------------------------------------------------------
    def partial_dir(self, step: int, tag: str | None = None) -> Path:
        """The folder to write step ``step`` into (created). ``tag`` must be equal on all ranks."""
        tag = tag or str(os.getpid())
        path = self.root / f".partial-step_{step:08d}-{tag}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def commit(self, step: int, partial: Path, metadata: dict | None = None) -> Path:
        """Mark ``partial`` complete and move it into place as ``step_<step>``; prune old ones."""
        partial = Path(partial)
        meta = {"step": step, "time": time.time(), **(metadata or {})}
        marker_tmp = partial / (MARKER + ".tmp")
        with open(marker_tmp, "w") as fh:
            json.dump(meta, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(marker_tmp, partial / MARKER)
        _fsync_dir(partial)
        final = self.root / f"step_{step:08d}"
        if final.exists():               # re-saving a step (e.g. after a resume): swap, then drop the old
            old = self.root / f".old-{final.name}-{os.getpid()}"
            os.replace(final, old)
            os.replace(partial, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(partial, final)
        _fsync_dir(self.root)
        self.prune()
        return final

    def save(self, step: int, write_fn, metadata: dict | None = None) -> Path:
        """Single-process convenience: ``write_fn(folder)`` writes the files, then commit."""
        partial = self.partial_dir(step)
        write_fn(partial)
        return self.commit(step, partial, metadata)

    def prune(self):
        done = self.complete()
        for _, folder in done[: max(0, len(done) - self.keep_last)]:
            shutil.rmtree(folder, ignore_errors=True)

    def clean_partials(self):
        """Remove folders left by crashed saves (call once at start-up, on one rank)."""
        if self.root.is_dir():
            for child in self.root.iterdir():
                if child.name.startswith((".partial-", ".old-")):
                    shutil.rmtree(child, ignore_errors=True)
