"""One recipe, then the object store's lifetime runs, on ONE set of workers and engines
(tests/e2e/test_dataplane_e2e.py runs it as a subprocess).

``python dataplane_runs.py RECIPE OUT_DIR``: builds one WorkerGroup, runs
``megarl.driver.loop.train`` with RECIPE in ``OUT_DIR/main`` and prints ``done main refs N1 N2
.. N`` (the object references the training ranks hold at each step's policy update, while the
step holds its passes' outputs, then after the run) and ``synced main S1 S2 ..`` (those they hold
after each step's weight sync: the step's objects are released by then).

``--lifetime STEPS``: then, on the same workers, STEPS steps in each of ``trainer.mode`` on_policy
and async (one prompt a step, no reference model: the old-log-prob pass and the correction's
objects remain; async with ``trainer.max_staleness`` 0: every step trains tokens of the version
it updates, the groups generated before a sync are dropped), printing ``life MODE ranks N1 .. N
controller C1 .. C engines E1 .. E``: the references the ranks, the controller and the engines
hold (ranks: at each step's policy update, ``ranks_synced``: after its weight sync; the
controller and the engines: after its weight sync), then after the run.
"""
import sys
from pathlib import Path

from megarl.config import load_config
from megarl.data.store import reference_count
from megarl.driver.loop import train
from megarl.actors.group import WorkerGroup


def main(recipe: str, out: str, lifetime: int = 0) -> None:
    cfg = load_config(recipe, [f"trainer.run_dir={Path(out) / 'main'}"])
    (Path(out) / "logs").mkdir(parents=True, exist_ok=True)
    with WorkerGroup(cfg, Path(out) / "logs") as group:
        refs, synced = [], []   # per step, the ranks' references at the update and after the weight sync
        count_at_update(group, refs)
        train(cfg, group=group, after_sync=lambda g, step: synced.append(sum(g.ranks.call("object_refs"))))
        refs.append(sum(group.ranks.call("object_refs")))   # after the run: the last step's objects released
        print(f"done main refs {' '.join(map(str, refs))}", flush=True)
        print(f"synced main {' '.join(map(str, synced))}", flush=True)
        for mode in ("on_policy", "async") if lifetime else ():
            cfg = load_config(recipe, [f"trainer.run_dir={Path(out) / mode}", f"trainer.steps={lifetime}",
                                       f"trainer.mode={mode}", "data.prompts_per_step=1", "algorithm.kl_coef=0.0",
                                       "trainer.max_staleness=0"])
            group.reuse_for(cfg)
            counts = {"ranks": [], "ranks_synced": [], "controller": [], "engines": []}
            count_at_update(group, counts["ranks"])

            def count(g, step: int) -> None:
                counts["ranks_synced"].append(sum(g.ranks.call("object_refs")))
                counts["controller"].append(reference_count())
                counts["engines"].append(sum(g.fleet.call_all("object_refs")))

            train(cfg, group=group, after_sync=count)
            counts["ranks"].append(sum(group.ranks.call("object_refs")))
            count(group, lifetime + 1)
            print(f"life {mode} " + " ".join(f"{k} {' '.join(map(str, v))}" for k, v in counts.items()), flush=True)


def count_at_update(group: WorkerGroup, into: list) -> None:
    """Append the ranks' object references to ``into`` just before each policy update (the step's
    passes' outputs are held then): ``group.train`` is wrapped (once)."""
    train = getattr(group.train, "__wrapped__", group.train)

    def counted(*args, **kwargs):
        into.append(sum(group.ranks.call("object_refs")))
        return train(*args, **kwargs)

    counted.__wrapped__ = train
    group.train = counted


if __name__ == "__main__":
    args = sys.argv[1:]
    steps = int(args.pop(args.index("--lifetime") + 1)) if "--lifetime" in args else 0
    args = [a for a in args if a != "--lifetime"]
    main(args[0], args[1], steps)
