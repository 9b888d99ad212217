"""Atomic, verified, keep-last-k checkpoint folders.

Layout under ``root``::

    step_00000003/          a complete checkpoint: its files, MANIFEST.json, COMPLETE (metadata)
    .partial-step_00000004-<tag>/   being written; never read, removed on the next start

:class:`CheckpointManager` owns these folders: a save writes into a ``.partial-*`` folder and
renames it to ``step_N`` only once its manifest and marker are on disk (:meth:`~CheckpointManager.commit`),
so a failed save leaves the older checkpoints untouched, and old ones are pruned only after the new
one is complete. Resume takes the newest checkpoint that verifies against its manifest (sizes and
CRC-32s) and loads (:meth:`~CheckpointManager.newest_intact`), skipping damaged ones with a
warning; ``megarl checkpoint verify DIR`` runs the same check.

Choices (:mod:`megarl.checkpoint_files`): CRC-32, which detects damage and not tampering, for
speed; the hashing is a ``Hasher`` the caller passes, so that the training workers read a large
checkpoint in parallel; loads execute no code.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

from megarl.checkpoint_files import (CheckpointError, Hasher, UnsafeCheckpointError, describe_error, folder_bytes,
                                     hash_files, human_bytes)

LOW_SPACE_BYTES = 64 * 2**20
"""Free space under which a failed save is blamed on a full disk (torch's writer then fails with
"[enforce fail at inline_container.cc] unexpected pos", which does not say so)."""

_STEP_RE = re.compile(r"^step_(\d{8})$")
MARKER = "COMPLETE"
MANIFEST = "MANIFEST.json"
def _fsync_dir(path: Path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, obj: dict):
    """Write ``path`` whole or not at all (temporary file, fsync, rename)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def list_files(folder: str | os.PathLike) -> list[str]:
    """Every file under ``folder`` (sorted paths relative to it), except the marker and manifest."""
    folder = Path(folder)
    skip = {MARKER, MANIFEST, MARKER + ".tmp", MANIFEST + ".tmp"}
    out = []
    for dirpath, _, names in os.walk(folder):
        rel_dir = Path(dirpath).relative_to(folder)
        out += [(rel_dir / n).as_posix() for n in names if rel_dir != Path(".") or n not in skip]
    return sorted(out)


class CheckpointManager:
    def __init__(self, root: str | os.PathLike, keep_last: int = 2):
        if keep_last < 1:
            raise ValueError(f"checkpoint.keep_last={keep_last!r}: expected an integer >= 1")
        self.root = Path(root)
        self.keep_last = keep_last

    # -- reading ---------------------------------------------------------------------------
    def step_folders(self) -> list[tuple[int, Path]]:
        """(step, folder) of every ``step_N`` folder, complete or not, oldest first."""
        if not self.root.is_dir():
            return []
        matches = ((_STEP_RE.match(child.name), child) for child in self.root.iterdir() if child.is_dir())
        return sorted((int(m.group(1)), child) for m, child in matches if m)

    def complete(self) -> list[tuple[int, Path]]:
        """(step, folder) of every checkpoint with its COMPLETE marker, oldest first."""
        return [(step, folder) for step, folder in self.step_folders() if (folder / MARKER).is_file()]

    def latest(self) -> tuple[int, Path] | None:
        """The newest checkpoint with a marker, unverified (resume uses :meth:`newest_intact`)."""
        done = self.complete()
        return done[-1] if done else None

    def metadata(self, folder: str | os.PathLike) -> dict:
        return json.loads((Path(folder) / MARKER).read_text())

    def manifest(self, folder: str | os.PathLike) -> dict | None:
        """The folder's MANIFEST.json (every file of the checkpoint, its path relative to the
        folder, its size and its CRC-32), or None when it has none."""
        path = Path(folder) / MANIFEST
        return json.loads(path.read_text()) if path.is_file() else None

    def verify(self, folder: str | os.PathLike, checksums: bool = True, hasher: Hasher | None = None) -> list[str]:
        """What is wrong with checkpoint ``folder``: one line per problem, each naming the file;
        empty when intact. ``checksums=False`` checks presence and sizes only (stat, no reads).
        A folder with a marker but no manifest has no problems: it is unverified, and accepted
        because its marker still proves the save finished (refusing it would strand the runs whose
        checkpoints carry no manifest)."""
        folder = Path(folder)
        if not folder.is_dir():
            return [f"{folder}: not a folder"]
        problems = []
        try:
            meta = self.metadata(folder)
            match = _STEP_RE.match(folder.name)
            if "step" not in meta:
                problems.append(f"{MARKER}: has no 'step' field (metadata: {sorted(meta)})")
            elif match and meta["step"] != int(match.group(1)):
                problems.append(f"{MARKER}: says step {meta['step']}, the folder name says {int(match.group(1))}")
        except FileNotFoundError:
            problems.append(f"{MARKER}: missing (the save did not finish, or the marker was deleted)")
        except (OSError, ValueError) as err:
            problems.append(f"{MARKER}: unreadable ({describe_error(err)})")
        try:
            manifest = self.manifest(folder)
            if manifest is not None and (manifest.get("checksum") != "crc32" or
                                         not isinstance(manifest.get("files"), dict)):
                raise ValueError(f"expected a 'files' dict and checksum 'crc32', got keys {sorted(manifest)} "
                                 f"and checksum {manifest.get('checksum')!r}")
        except (OSError, ValueError) as err:
            return problems + [f"{MANIFEST}: unreadable ({describe_error(err)})"]
        if manifest is None:
            return problems + ([f"{MANIFEST}: missing"] if problems else [])
        to_hash = []
        for rel, want in sorted(manifest["files"].items()):
            try:
                size = (folder / rel).stat().st_size
            except FileNotFoundError:
                problems.append(f"{rel}: missing")
                continue
            if size != want["size"]:
                how = "truncated" if size < want["size"] else "grown"
                problems.append(f"{rel}: {size} bytes, the manifest says {want['size']} ({how})")
            else:
                to_hash.append(rel)
        if checksums and to_hash:
            try:
                got = (hasher or hash_files)(folder, to_hash, False)
            except Exception as err:   # e.g. EIO, or a hashing worker that died: the bytes are not readable
                return problems + [f"reading the files failed: {describe_error(err)}"]
            for rel in to_hash:
                want = manifest["files"][rel]["crc32"]
                if got[rel]["crc32"] != want:
                    problems.append(f"{rel}: checksum {got[rel]['crc32']}, the manifest says {want} "
                                    "(the content changed)")
        return problems

    def newest_intact(self, load_fn: Callable[[Path], object] | None = None,
                      hasher: Hasher | None = None) -> tuple[int, Path] | None:
        """The newest checkpoint that verifies and, when ``load_fn`` is given, that
        ``load_fn(folder)`` loads without raising; damaged ones are skipped with a WARNING on the
        ``megarl`` logger. None when there is no checkpoint at all; :class:`CheckpointError`
        naming every folder and its problems when there are some but none is usable.
        ``load_fn`` must overwrite all state it restores, since a failed load may have restored
        part of a newer checkpoint before an older one is tried. Each WARNING names the folder, the
        file and what is wrong; an :class:`UnsafeCheckpointError` is raised, not skipped."""
        log = logging.getLogger("megarl")
        rejected = []
        for step, folder in reversed(self.step_folders()):
            problems = self.verify(folder, hasher=hasher)
            if not problems and not (folder / MANIFEST).is_file():
                log.warning(f"checkpoint {folder} has no {MANIFEST} (written by an older megarl): using it "
                            "unverified")
            if not problems and load_fn is not None:
                try:
                    load_fn(folder)
                except UnsafeCheckpointError:   # not damage: someone put code there; stop, do not fall back
                    raise
                except Exception as err:   # the manifest cannot see every damage (e.g. valid size and CRC, bad pickle)
                    problems = [f"loading failed: {describe_error(err)}"]
            if not problems:
                return step, folder
            log.warning(f"skipping damaged checkpoint {folder}: {'; '.join(problems)}")
            rejected.append(f"  {folder}: {'; '.join(problems)}")
        if rejected:
            raise CheckpointError(f"no intact checkpoint in {self.root} ({len(rejected)} found, newest first):\n"
                                  + "\n".join(rejected))
        return None

    def _newest_complete(self) -> Path | None:
        """The newest checkpoint whose files are all there with their sizes (no reads)."""
        return next((f for _, f in reversed(self.complete()) if not self.verify(f, checksums=False)), None)

    # -- writing ---------------------------------------------------------------------------
    def partial_dir(self, step: int, tag: str | None = None) -> Path:
        """The folder to write step ``step`` into (created). ``tag`` must be equal on all ranks:
        in a multi-process job every rank writes its shards into the same partial folder (the
        caller passes it to megatron's ``dist_checkpointing.save``), then the controller alone
        calls :meth:`commit` once every rank has returned."""
        tag = tag or str(os.getpid())
        path = self.root / f".partial-step_{step:08d}-{tag}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def commit(self, step: int, partial: Path, metadata: dict | None = None, hasher: Hasher | None = None) -> Path:
        """Record ``partial``'s files in its manifest (hashed by ``hasher``, with an fsync of each
        file, default: :func:`hash_files` here), mark it complete and move it into place as
        ``step_<step>``; prune old ones.

        Atomicity: ``MANIFEST.json`` and the ``COMPLETE`` marker are written and fsync'ed, in that
        order, inside ``partial``, and only then is the folder renamed (a rename within one file
        system is atomic); a crash at any point before the rename leaves the older checkpoints
        untouched."""
        partial = Path(partial)
        files = list_files(partial)
        hashed = (hasher or hash_files)(partial, files, True)
        if missing := sorted(set(files) - set(hashed)):
            raise CheckpointError(f"the hasher returned no checksum for {len(missing)} files of {partial}, "
                                  f"e.g. {missing[:3]}")
        _write_json(partial / MANIFEST, {"format": 1, "checksum": "crc32", "files": {f: hashed[f] for f in files}})
        _write_json(partial / MARKER, {"step": step, "time": time.time(), **(metadata or {})})
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
        self.prune(keep=final)
        return final

    def save(self, step: int, write_fn: Callable[[Path], object], metadata: dict | None = None,
             hasher: Hasher | None = None, tag: str | None = None) -> Path:
        """``write_fn(folder)`` writes the files into a partial folder, then :meth:`commit`. Any
        failure (a full disk: ENOSPC, a file-size limit: EFBIG, a worker's error) raises
        :class:`CheckpointError` naming the step, the partial folder, the cause and the newest
        complete checkpoint, which stays loadable; the partial folder is removed at the next start
        (:meth:`clean_partials`)."""
        partial = None
        try:
            partial = self.partial_dir(step, tag)
            write_fn(partial)
            return self.commit(step, partial, metadata, hasher)
        except Exception as err:
            newest = self._newest_complete()
            still = f"the newest complete checkpoint is still {newest}" if newest else \
                f"there is no complete checkpoint in {self.root} yet"
            cause = describe_error(err)
            full = self.disk_full(partial, newest)
            raise CheckpointError(f"saving the checkpoint of step {step} into {partial or self.root} failed: "
                                  f"{full + ' (' + cause + ')' if full else cause}; {still} (the partial folder is "
                                  "removed at the next start)") from err

    def disk_full(self, partial: Path | None, newest: Path | None) -> str | None:
        """Why a save failed when the disk is full (the folder has less than :data:`LOW_SPACE_BYTES`
        free after the failure): the free space, what the save had written, the size of the last
        complete checkpoint. None when the disk is not the cause (an ENOSPC with room left is a
        quota or the inodes: the error says so itself)."""
        existing = self.root
        while not existing.exists():
            existing = existing.parent
        free = shutil.disk_usage(existing).free
        if free >= LOW_SPACE_BYTES:
            return None
        last = f", the last complete checkpoint ({newest.name}) takes {human_bytes(folder_bytes(newest))}" \
            if newest else ""
        return (f"the disk is full: {self.root} has {human_bytes(free)} free; the save had written "
                f"{human_bytes(folder_bytes(partial) if partial else 0)}{last}; free space or set checkpoint.dir to "
                "a folder on a larger disk")

    def prune(self, keep: Path | None = None):
        """Delete checkpoints older than the ``keep_last`` newest ones whose files are all there
        with their sizes. Damaged ones do not count, so that a damaged newer checkpoint never
        causes the removal of an intact older one; ``keep`` (the one just committed) always stays."""
        done = self.complete()
        intact = [f for _, f in done if f == keep or not self.verify(f, checksums=False)]
        kept = set(intact[-self.keep_last:]) | {keep}
        kept_steps = [step for step, f in done if f in kept]
        for step, folder in done:
            if kept_steps and step < min(kept_steps):
                shutil.rmtree(folder, ignore_errors=True)

    def clean_partials(self):
        """Remove folders left by crashed saves (call once at start-up, on one rank)."""
        if self.root.is_dir():
            for child in self.root.iterdir():
                if child.name.startswith((".partial-", ".old-")):
                    shutil.rmtree(child, ignore_errors=True)


def find_checkpoints(path: str | os.PathLike) -> list[Path]:
    """The checkpoint folders ``path`` names, oldest first: itself when it is one (a ``step_N``
    folder, or any folder with a marker or manifest), else its ``step_N`` folders, else those of
    ``path/checkpoints`` (a run dir)."""
    path = Path(path)
    if not path.is_dir():
        return []
    if _STEP_RE.match(path.name) or (path / MARKER).is_file() or (path / MANIFEST).is_file():
        return [path]
    for root in (path, path / "checkpoints"):
        if found := CheckpointManager(root).step_folders():
            return [folder for _, folder in found]
    return []


__all__ = ["CheckpointManager", "CheckpointError", "UnsafeCheckpointError", "hash_files", "list_files",
           "load_plain", "describe_error",
           "find_checkpoints", "MARKER", "MANIFEST"]
