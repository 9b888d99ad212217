"""Helpers shared by the test folders (unit, e2e, distributed): ``from helpers import ...``.

tests/ is on ``sys.path`` through tests/conftest.py under pytest, and through
tests/e2e/e2e_common.py for the scripts that import that file (perf/ab_commits.py).
"""
import json
from pathlib import Path
from types import SimpleNamespace


def write_jsonl(path, rows) -> str:
    """``rows`` into ``path``, one a line: a dict as JSON, a str as it is (a blank or broken row);
    returns the path as a str."""
    Path(path).write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def read_jsonl(path, missing_ok: bool = False) -> list:
    """The rows of the JSON-lines file ``path``; ``missing_ok``: none when it does not exist."""
    path = Path(path)
    if missing_ok and not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def smollm2_tokenizer(auto: bool = False):
    """The tokenizer of the smollm2 fixture, loaded anew: a ``PreTrainedTokenizerFast`` (no torch
    import, unlike AutoTokenizer: ~3 s), or with ``auto`` what ``AutoTokenizer`` gives."""
    from megarl.models.fixtures import resolve_model_path

    if auto:
        from transformers import AutoTokenizer as cls
    else:
        from transformers import PreTrainedTokenizerFast as cls
    return cls.from_pretrained(resolve_model_path("fixture:smollm2"))


def flat_sorted(parts) -> list:
    """The items of every part, sorted (a partition's parts -> what it partitioned)."""
    return sorted(i for p in parts for i in p)


class PrefixTokenizer:
    """A text -> its first 6 characters' codes mod 50; response ids -> that many letters (no chat
    template): the async source's stand-in (tests/unit/test_modes.py, tests/e2e/test_fleet_controller.py)."""

    def __call__(self, text):
        return SimpleNamespace(input_ids=[ord(c) % 50 for c in text[:6]])

    def batch_decode(self, ids, skip_special_tokens=True):
        return ["x" * len(t) for t in ids]


class AlternatingRewards:
    """``RewardPool.score``: 0, 1, 0, 1, ... by position, whatever the texts."""

    def score(self, name, texts, answers, extras=None):
        return SimpleNamespace(rewards=[float(i % 2) for i in range(len(texts))], n_errors=0, n_timeouts=0)


def read_wandb_offline(run_dir) -> list[dict]:
    """The offline wandb runs under ``<run_dir>/wandb``, oldest first, read with wandb's own record
    schema (``wandb.proto.wandb_internal_pb2.Record``) from their ``run-<id>.wandb`` files, whose
    framing is LevelDB's log format (32 KiB blocks of records with a 7-byte header: checksum,
    length, type full / first / middle / last) after a 7-byte file header (":W&B", magic, version).
    Each run: {"id", "config": {key: value}, "history": {step: {key: value}}}."""
    import struct

    from wandb.proto import wandb_internal_pb2

    runs = []
    for folder in sorted(Path(run_dir, "wandb").glob("offline-run-*")):
        [file] = folder.glob("run-*.wandb")
        data = file.read_bytes()
        assert data[:4] == b":W&B", file
        records, part, pos, block = [], b"", 7, 32768
        while pos + 7 <= len(data):
            if block - pos % block < 7:                  # a block's tail too short for a header: padding
                pos += block - pos % block
                continue
            _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            if kind == 0:
                break
            part += data[pos + 7:pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):                            # full, or the last piece of a record
                records.append(part)
                part = b""
        run = {"id": None, "config": {}, "history": {}}
        for raw in records:
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(raw)
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                run["id"] = rec.run.run_id
                run["config"].update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
            elif kind == "config":
                run["config"].update({i.key: json.loads(i.value_json) for i in rec.config.update})
            elif kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                run["history"].setdefault(items["_step"], {}).update(items)
        runs.append(run)
    return runs


def read_tensorboard_scalars(run_dir) -> dict:
    """{tag: {step: value}} of ``<run_dir>/tensorboard``, read with TensorBoard's event reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(Path(run_dir, "tensorboard")), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
