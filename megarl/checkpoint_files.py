"""A checkpoint's files, as every process that writes or reads them sees them: CRC-32 manifests
and loads that run no code.

The controller's :class:`megarl.driver.checkpoint.CheckpointManager` owns the folders (atomic
saves, keep-last-k, resume from the newest intact one); the training ranks write their shards
into them, hash their slice of the files for the manifest (:func:`hash_files`) and load their RNG
state (:func:`load_plain`). Both sides raise the errors defined here.
"""
from __future__ import annotations

import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

_CHUNK = 4 << 20          # bytes per read: large enough that the GIL is released for most of the time
_THREADS = 8

Hasher = Callable[[Path, list[str], bool], dict]
"""``hasher(folder, relpaths, sync) -> {relpath: {"size": int, "crc32": "8 hex digits"}}``; ``sync``:
fsync each file too (at save time). :func:`hash_files` is one.

Who reads the bytes: a 671B checkpoint with its optimizer state is ~10 TB; one controller reading
it at a node's 2-5 GB/s would take an hour. So :class:`megarl.actors.group.WorkerGroup` passes
a hasher that has every training worker hash a disjoint slice (``files[rank::world]``) in
parallel, each with its own thread pool, and the controller merges the slices into the manifest;
at save time (right after the write, with an fsync of each file, so that a COMPLETE checkpoint's
data is on disk and not only in the page cache) and again at resume. The default hasher (single
process, tests, the CLI) is :func:`hash_files`."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or no checkpoint could be loaded; the message names
    the folders, files and causes."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file holds pickled objects that loading would construct by running code
    (anything but tensors and plain data): refused, never loaded. Resume does not treat it as
    damage to fall back from: it stops and names the file."""


def load_plain(path: str | os.PathLike):
    """``torch.load(path, weights_only=True)`` on the CPU; a file that holds anything but tensors,
    numbers, strings and containers raises :class:`UnsafeCheckpointError` naming it and the
    offending global, and nothing of it runs.

    Loads execute no code: a checkpoint folder is whatever ``--resume`` or ``checkpoint.dir``
    points at, and a pickle runs arbitrary code when loaded. The RNG files load here, megatron's
    ``common.pt`` likewise (torch's default since 2.6), the markers and manifests are JSON, and the
    distributed checkpoint's own pickles (torch DCP's ``.metadata`` and the byte items such as TE's
    ``_extra_state``) go through the allowlists of :mod:`megarl.compat.megatron_fixes` (M2)."""
    from megarl.compat.megatron_fixes import UnsafePickleError, load_weights_only

    try:
        return load_weights_only(path, str(path), map_location="cpu")
    except UnsafePickleError as err:
        raise UnsafeCheckpointError(f"{err}; megarl loads checkpoint files as plain tensors and data only "
                                    "(weights_only). Only resume from checkpoints you trust.") from err


def _hash_one(path: Path, sync: bool) -> dict:
    crc, size = 0, 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
            size += n
        if sync:          # the data must reach the disk before COMPLETE says the checkpoint is there
            os.fsync(fh.fileno())
    return {"size": size, "crc32": f"{crc:08x}"}


def hash_files(folder: str | os.PathLike, relpaths: list[str], sync: bool = False,
               threads: int = _THREADS) -> dict:
    """Size and CRC-32 of each file ``folder/relpath`` (a :data:`Hasher`); ``sync`` also fsyncs
    each file. Files are hashed in parallel by ``threads`` threads (zlib and file reads release
    the GIL), with 4 MiB reads.

    Why CRC-32: measured on a 2-core VM over in-memory buffers, crc32 runs at 3.4 GB/s per core,
    adler32 2.0, sha1 1.1 (SHA-NI), sha256 1.1, md5 0.54, blake2b 0.40 GB/s. Over 8 files of
    128 MiB in the page cache this function reads 0.75-1.1 GB/s with one thread, 1.4 GB/s with two
    (both cores), 0.55 GB/s with the fsync of a save: copying the bytes out of the kernel, not the
    CRC, is the limit. CRC-32 detects damage (truncation, torn writes, flipped bits), not tampering."""
    folder = Path(folder)
    if not relpaths:
        return {}
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(relpaths)))) as pool:
        results = pool.map(lambda rel: _hash_one(folder / rel, sync), relpaths)
        return dict(zip(relpaths, results))


def human_bytes(num_bytes: int) -> str:
    """``num_bytes`` in B, KiB, MiB, GiB or TiB, one decimal."""
    units, size, i = ("B", "KiB", "MiB", "GiB", "TiB"), float(num_bytes), 0
    while size >= 1024 and i < len(units) - 1:
        size, i = size / 1024, i + 1
    return f"{size:.1f} {units[i]}" if i else f"{num_bytes} B"


def folder_bytes(folder: str | os.PathLike) -> int:
    """Bytes of the files under ``folder`` (0 when it does not exist)."""
    return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file()) if Path(folder).is_dir() else 0


def describe_error(err: BaseException) -> str:
    """One line ``Type: message`` for an exception. Ray's RayTaskError is unwrapped to the worker's
    own exception (its str is the whole remote traceback) and torch.distributed.checkpoint's
    CheckpointException (a dict of per-rank failures) to its first rank's."""
    while isinstance(getattr(err, "cause", None), BaseException):
        err = err.cause
    where = ""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, failure = next(iter(failures.items()))
        err, where = (failure[0] if isinstance(failure, tuple) else failure), f" (rank {rank})"
    lines = str(err).strip().splitlines()
    text = lines[0][:500] if lines else ""
    return f"{type(err).__name__}: {text}{where}" if text else f"{type(err).__name__}{where}"
