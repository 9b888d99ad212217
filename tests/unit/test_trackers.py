"""logging.trackers with the real wandb (offline) and mlflow (SQLite store), read back with their own
readers: MlflowClient, wandb's record schema, TensorBoard's event reader. No engine: a MetricsLogger
fed as a run feeds it (the whole loop with every tracker: tests/e2e/test_algorithms_e2e.py)."""
import io
import json
import logging

import pytest
from helpers import read_jsonl, read_tensorboard_scalars, read_wandb_offline

from megarl.config import load_config
from megarl.config.errors import ConfigError
from megarl.observability.metrics import open_metrics
from megarl.observability.trackers import IDS_FILE, missing_tracker

pytest.importorskip("wandb")
pytest.importorskip("mlflow")
ALL = "logging.trackers=[jsonl,tensorboard,wandb,mlflow]"
SAMPLE = {"id": "s1.g0.0", "reward": 1.0, "length": 3, "gap": 0, "prompt": "1+1=", "response": "2",
          "response_ids": [17], "prompt_ids": [1, 2]}


def feed(cfg, run_dir, start: int, steps: range, status=None) -> None:
    """Steps ``steps`` of a run resumed after checkpoint ``start`` (0: fresh), as train logs them."""
    with open_metrics(cfg, run_dir, total_steps=steps[-1], start=start, stream=io.StringIO()) as log:
        log.add_text("precision", "precision: params float32", start + 1)
        for step in steps:
            with log.step(step) as m:
                m.update({"reward/mean": 0.25 * step, "actor/loss": 1.0 / step, "time/train_s": 0.5})
            log.add_samples(step, [SAMPLE])


def mlflow_runs(run_dir, experiment="megarl"):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    exp = client.get_experiment_by_name(experiment)
    return client, client.search_runs([exp.experiment_id])


def test_every_tracker_gets_config_metrics_and_samples_and_resume_continues_the_runs(tmp_path):
    run_dir = tmp_path / "run"
    cfg = load_config(None, [ALL, f"trainer.run_dir={run_dir}", "logging.stdout=false", "logging.project=arith"])
    feed(cfg, run_dir, 0, range(1, 4))
    ids = json.loads((run_dir / IDS_FILE).read_text())
    feed(cfg, run_dir, 2, range(3, 5))                  # resumed after step 2's checkpoint: steps 3 and 4 again
    rows = {r["step"]: r for r in read_jsonl(run_dir / "metrics.jsonl")}
    assert sorted(rows) == [1, 2, 3, 4]
    # mlflow: one run (resumed), the params, every step's metrics, the sample tables
    client, runs = mlflow_runs(run_dir, "arith")               # logging.project: the experiment
    assert [r.info.run_id for r in runs] == [ids["mlflow"]] and runs[0].info.status == "FINISHED"
    run = runs[0]
    assert run.data.params["algorithm.name"] == cfg.algorithm.name and run.data.params["logging.trackers"] == \
        json.dumps(cfg.logging.trackers)
    assert run.data.tags["precision"] == "precision: params float32"
    for key in ("reward/mean", "actor/loss"):
        history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        assert history == {s: rows[s][key] for s in rows}, key
    table = json.loads((run_dir / "mlflow-artifacts").joinpath(
        run.info.run_id, "artifacts", "samples", "step_000004.json").read_text())
    assert table["columns"][:4] == ["step", "id", "prompt", "response"] and table["data"][0][:4] == \
        [4, "s1.g0.0", "1+1=", "2"]
    # wandb: two offline launches of one run id, the config, each launch's steps, the sample tables
    first, second = read_wandb_offline(run_dir)
    assert first["id"] == second["id"] == ids["wandb"]
    assert first["config"]["algorithm.name"] == cfg.algorithm.name
    assert {s: h["reward/mean"] for s, h in first["history"].items()} == {1: 0.25, 2: 0.5, 3: 0.75}
    assert {s: h["reward/mean"] for s, h in second["history"].items()} == {3: 0.75, 4: 1.0}
    assert second["history"][4]["samples/_type"] == "table-file"
    media = list((run_dir / "wandb").glob("offline-run-*/files/media/table/samples_4_*.table.json"))
    assert json.loads(media[0].read_text())["data"][0][:4] == [4, "s1.g0.0", "1+1=", "2"]
    # TensorBoard
    tb = read_tensorboard_scalars(run_dir)
    assert {s: v for s, v in tb["reward/mean"].items()} == pytest.approx({s: rows[s]["reward/mean"] for s in rows})
    # a fresh run (not resumed) in the same folder starts new tracker runs
    feed(cfg, run_dir, 0, range(1, 2))
    assert json.loads((run_dir / IDS_FILE).read_text())["mlflow"] != ids["mlflow"]
    assert len(mlflow_runs(run_dir, "arith")[1]) == 2


def test_a_failing_tracker_warns_once_and_training_goes_on(tmp_path, caplog, monkeypatch):
    base = tmp_path / "plain"
    feed(load_config(None, [f"trainer.run_dir={base}", "logging.trackers=[jsonl]"]), base, 0, range(1, 4))
    # mlflow cannot open its store; wandb starts, then raises on every call from step 2 on
    bad = tmp_path / "bad"
    cfg = load_config(None, [ALL, f"trainer.run_dir={bad}", "logging.mlflow_tracking_uri=sqlite:////proc/no/mlflow.db"])
    import wandb

    logged = []
    real = wandb.sdk.wandb_run.Run.log

    def failing_log(self, data, step=None, **kw):
        logged.append(step)
        if step >= 2:
            raise ConnectionError("wandb backend gone")
        return real(self, data, step=step, **kw)

    monkeypatch.setattr(wandb.sdk.wandb_run.Run, "log", failing_log)
    with caplog.at_level(logging.WARNING, logger="megarl"):
        feed(cfg, bad, 0, range(1, 4))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len([w for w in warnings if "mlflow did not start" in w]) == 1, warnings
    assert len([w for w in warnings if "wandb failed in metrics()" in w and "wandb backend gone" in w]) == 1, warnings
    assert logged == [1, 1, 2]                           # step 1's metrics and samples, step 2's metrics: then off
    assert read_jsonl(bad / "metrics.jsonl") == read_jsonl(base / "metrics.jsonl")


def test_a_tracker_not_installed_is_refused_with_the_install_command(tmp_path, monkeypatch):
    import importlib.util

    from megarl.preflight import preflight

    assert missing_tracker(["jsonl", "tensorboard", "wandb", "mlflow"]) is None
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    cfg = load_config(None, [ALL, f"trainer.run_dir={tmp_path / 'run'}", "model.path=fixture:tiny-llama"])
    with pytest.raises(ConfigError, match=r"^logging.trackers: wandb needs wandb, not installed here: "
                                          r"pip install -e '\.\[trackers\]'"):
        preflight(cfg, "train", backend="cpu")
    with pytest.raises(ConfigError, match="logging.trackers"):
        load_config(None, ["logging.trackers=[jsonl,neptune]"])
    with pytest.raises(ConfigError, match=r"'logging.tensorboard' moved to 'logging.trackers"):
        load_config(None, ["logging.tensorboard=false"])
