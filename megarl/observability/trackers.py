"""Experiment trackers: where a run's metrics, config and samples go besides the terminal.

``logging.trackers`` names them, in every command that trains: ``jsonl`` (<run_dir>/metrics.jsonl,
the run's own record, written by MetricsLogger itself), ``tensorboard`` (<run_dir>/tensorboard),
``wandb`` (offline into <run_dir>/wandb unless an API key is configured: ``WANDB_API_KEY`` or
``wandb login``; ``WANDB_MODE`` wins; ``wandb sync`` uploads later) and ``mlflow``
(``MLFLOW_TRACKING_URI`` or ``logging.mlflow_tracking_uri``, else a SQLite store
<run_dir>/mlflow.db: mlflow's file store rejects the "/" of megarl's metric names). Each gets the
resolved config as flat ``section.key`` params, every step's metrics at their step, the run's
precision line and, every ``logging.samples_every`` steps, the sample table.

Resume: the wandb and mlflow run ids live in <run_dir>/trackers.json; a resumed run logs into the
same runs, a fresh run in the folder starts new ones. A tracker call that raises is logged once (a
warning naming the tracker and the error) and that tracker is off for the rest of the run:
trackers never stop training. wandb and mlflow are optional (``pip install -e .[trackers]``);
preflight refuses one that is named but not installed (:func:`missing_tracker`).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import math
import os
import re
import time
from pathlib import Path

from megarl.config.schema import TRACKERS

__all__ = ["TRACKERS", "IDS_FILE", "Tracker", "config_params", "missing_tracker", "open_trackers"]

IDS_FILE = "trackers.json"
"""In the run folder: the wandb and mlflow run ids a resumed run continues."""
INSTALL = "pip install -e '.[trackers]'"
SAMPLE_COLUMNS = ("step", "id", "prompt", "response", "reward", "length", "gap")

_log = logging.getLogger("megarl")


def missing_tracker(names: list[str], mlflow_uri: str = "") -> str | None:
    """The install hint for the first tracker of ``names`` whose package is not importable (None:
    all are). The default mlflow store is SQLite, which needs sqlalchemy and alembic too."""
    need = {"wandb": ["wandb"], "mlflow": ["mlflow"]}
    for name in names:
        modules = list(need.get(name, []))
        if name == "mlflow" and not (mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI")):
            modules += ["sqlalchemy", "alembic"]
        absent = [m for m in modules if importlib.util.find_spec(m) is None]
        if absent:
            return f"{name} needs {', '.join(absent)}, not installed here: {INSTALL}"
    return None


def config_params(cfg) -> dict[str, str | int | float | bool | None]:
    """The resolved config as flat ``section.key`` params (lists as JSON)."""
    out: dict = {}

    def walk(obj, prefix: str):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, f"{prefix}{f.name}.")
            else:
                out[f"{prefix}{f.name}"] = value if isinstance(value, (str, int, float, bool, type(None))) \
                    else json.dumps(value, default=str)

    walk(cfg, "")
    return out


class Tracker:
    """One tracker's side of a run. Every method may raise: :class:`Guarded` turns a failure into
    one warning and switches the tracker off."""

    name = ""

    def metrics(self, step: int, values: dict[str, float | None]) -> None:
        raise NotImplementedError

    def text(self, tag: str, text: str, step: int) -> None:
        """A text entry (the precision line, the samples as markdown where there is no table)."""

    def samples(self, step: int, rows: list[dict]) -> None:
        """The sample table of ``step``: one dict per sample with :data:`SAMPLE_COLUMNS`."""

    def close(self, status: str) -> None:
        """End the run: ``status`` finished, failed (an error) or killed (interrupted)."""


class Guarded:
    """A tracker whose first failure is logged once and switches it off."""

    def __init__(self, tracker: Tracker):
        self.tracker, self.name, self.off = tracker, tracker.name, False

    def call(self, method: str, *args) -> None:
        if self.off:
            return
        try:
            getattr(self.tracker, method)(*args)
        except Exception as err:   # noqa: BLE001 - a tracker never stops training
            self.off = True
            _log.warning(f"logging.trackers: {self.name} failed in {method}() and is off for the rest of the run: "
                         f"{type(err).__name__}: {err}")
            _log.debug(f"{self.name} tracker failure", exc_info=True)


def _finite(values: dict) -> dict[str, float]:
    return {k: float(v) for k, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class TensorBoard(Tracker):
    name = "tensorboard"

    def __init__(self, run_dir: Path, params: dict | None):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        if params:
            self.writer.add_text("config", "\n".join(f"    {k}: {v}" for k, v in params.items()), 0)

    def metrics(self, step, values):
        for key, value in values.items():
            if value is not None:
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def text(self, tag, text, step):
        self.writer.add_text(tag, text, step)
        self.writer.flush()

    def samples(self, step, rows):
        from megarl.observability.generations import format_samples

        self.text("generations", format_samples(step, rows, markdown=True), step)

    def close(self, status):
        self.writer.close()


def _wandb_mode() -> str:
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        import netrc

        return "online" if netrc.netrc().authenticators("api.wandb.ai") else "offline"
    except (OSError, netrc.NetrcParseError):
        return "offline"


class Wandb(Tracker):
    name = "wandb"

    def __init__(self, run_dir: Path, params: dict, project: str, run_id: str | None):
        import wandb

        self.wandb = wandb
        (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
        # console off: wandb must not wrap the terminal (megarl's table and progress line own it)
        settings = wandb.Settings(console="off", silent=True, show_info=False, show_warnings=False,
                                  x_disable_stats=True)
        self.run = wandb.init(project=project, name=run_dir.resolve().name, dir=str(run_dir), mode=_wandb_mode(),
                              config=params, id=run_id, resume="allow" if run_id else None, settings=settings)
        self.id = self.run.id

    def metrics(self, step, values):
        self.run.log({k: v for k, v in values.items() if v is not None}, step=step)

    def text(self, tag, text, step):
        self.run.summary[tag] = text

    def samples(self, step, rows):
        table = self.wandb.Table(columns=list(SAMPLE_COLUMNS), data=[[r.get(c) for c in SAMPLE_COLUMNS] for r in rows])
        self.run.log({"samples": table}, step=step)

    def close(self, status):
        self.run.finish(exit_code=0 if status == "finished" else 1)


_MLFLOW_KEY = re.compile(r"[^\w\-. /:]")


class Mlflow(Tracker):
    name = "mlflow"

    def __init__(self, run_dir: Path, params: dict, project: str, uri: str, run_id: str | None):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        # the sqlite store's first open creates its tables: mlflow's alembic logs that at INFO
        for name in ("mlflow", "alembic"):
            logging.getLogger(name).setLevel(logging.WARNING)
        self.client = MlflowClient(tracking_uri=uri)
        self.uri = uri
        if run_id is not None:
            self.run_id = self.client.get_run(run_id).info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            exp = self.client.get_experiment_by_name(project)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(
                project, artifact_location=(run_dir / "mlflow-artifacts").resolve().as_uri()
                if uri.startswith("sqlite:") else None)
            self.run_id = self.client.create_run(exp_id, run_name=run_dir.resolve().name).info.run_id
            items = [Param(k, str(v)[:6000]) for k, v in params.items()]
            for i in range(0, len(items), 100):      # mlflow takes at most 100 params a batch
                self.client.log_batch(self.run_id, params=items[i:i + 100])

    def metrics(self, step, values):
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(_MLFLOW_KEY.sub("_", k), v, now, step) for k, v in _finite(values).items()]
        for i in range(0, len(items), 1000):
            self.client.log_batch(self.run_id, metrics=items[i:i + 1000])

    def text(self, tag, text, step):
        self.client.set_tag(self.run_id, tag, text[:5000])

    def samples(self, step, rows):
        data = {c: [r.get(c) for r in rows] for c in SAMPLE_COLUMNS}
        self.client.log_table(self.run_id, data=data, artifact_file=f"samples/step_{step:06d}.json")

    def close(self, status):
        self.client.set_terminated(self.run_id, status=status.upper())


def open_trackers(cfg, run_dir: str | os.PathLike, resumed: bool) -> list[Guarded]:
    """The trackers ``cfg.logging.trackers`` names, other than jsonl, started for ``run_dir``;
    with ``resumed``, wandb and mlflow continue the runs ``trackers.json`` names. A tracker that
    fails to start is logged once and left out."""
    run_dir = Path(run_dir)
    names = [n for n in cfg.logging.trackers if n != "jsonl"]
    if not names:
        return []
    params = config_params(cfg)
    ids_path = run_dir / IDS_FILE
    ids = {}
    if resumed and ids_path.is_file():
        try:
            ids = json.loads(ids_path.read_text())
        except ValueError:
            _log.warning(f"logging.trackers: {ids_path} is not JSON; wandb and mlflow start new runs")
    out, started = [], {}
    for name in names:
        try:
            if name == "tensorboard":
                tracker = TensorBoard(run_dir, params)
            elif name == "wandb":
                tracker = Wandb(run_dir, params, cfg.logging.project, ids.get("wandb"))
                started["wandb"] = tracker.id
            elif name == "mlflow":
                uri = os.environ.get("MLFLOW_TRACKING_URI") or cfg.logging.mlflow_tracking_uri or \
                    f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
                same_store = ids.get("mlflow_uri") == uri
                tracker = Mlflow(run_dir, params, cfg.logging.project, uri, ids.get("mlflow") if same_store else None)
                started.update(mlflow=tracker.run_id, mlflow_uri=uri)
            else:
                raise ValueError(f"unknown tracker {name!r}; expected one of {TRACKERS}")
        except Exception as err:   # noqa: BLE001 - a tracker never stops training
            _log.warning(f"logging.trackers: {name} did not start and is off for this run: {type(err).__name__}: {err}")
            _log.debug(f"{name} tracker start failure", exc_info=True)
            continue
        out.append(Guarded(tracker))
    if started:   # a resumed run keeps the ids of trackers that did not start this time
        tmp = ids_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({**ids, **started}, indent=1) + "\n")
        os.replace(tmp, ids_path)
    return out
