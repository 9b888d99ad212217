"""One recipe twice on ONE set of workers and engines, once per ``trainer.data_plane``, from the
same weights (tests/e2e/test_dataplane_e2e.py runs it as a subprocess).

``python plane_parity.py RECIPE OUT_DIR``: builds one WorkerGroup, saves its starting weights and
optimizer state (a raw worker checkpoint in ``OUT_DIR/start``), runs
``megarl.trainer.loop.train`` with ``trainer.data_plane=object_store`` in ``OUT_DIR/object_store``,
loads the start back (the engines get its weights), then runs it with ``controller`` in
``OUT_DIR/controller``; prints ``done PLANE refs N1 N2 .. N`` after each (the object references
the training ranks hold after each step's weight sync, then after the run) and exits 0 when
both ran.

``--lifetime STEPS``: then, on the same workers, the object-store plane for STEPS steps in each of
``trainer.mode`` on_policy and async (one prompt a step, no reference model: the old-log-prob pass
and the correction's objects remain; async with ``trainer.max_staleness`` 0: every step trains
tokens of the version it updates, the groups generated before a sync are dropped), printing
``life MODE ranks N1 .. N controller C1 .. C engines E1 .. E``: the references the ranks, the controller and the engines hold after each step's weight
sync, then after the run (issue 36: nothing grows across steps).
"""
import sys
from pathlib import Path

from megarl.config import load_config
from megarl.data.store import reference_count
from megarl.trainer.loop import train
from megarl.trainer.workers import WorkerGroup

PLANES = ("object_store", "controller")


def main(recipe: str, out: str, lifetime: int = 0) -> None:
    configs = [load_config(recipe, [f"trainer.data_plane={plane}", f"trainer.run_dir={Path(out) / plane}"])
               for plane in PLANES]
    (Path(out) / "logs").mkdir(parents=True, exist_ok=True)
    start = Path(out) / "start"
    with WorkerGroup(configs[0], Path(out) / "logs") as group:
        start.mkdir()
        group._all("save_checkpoint", str(start))   # both runs start from these weights and this optimizer state
        for plane, cfg in zip(PLANES, configs):
            if plane != PLANES[0]:
                group.load_checkpoint(start)
                group.reuse_for(cfg)
            refs = []   # per step, after its weight sync (the step's passes still held): the ranks' references
            train(cfg, group=group, after_sync=lambda g, step: refs.append(sum(g._all("object_refs"))))
            refs.append(sum(group._all("object_refs")))   # after the run: the last step's objects released
            print(f"done {plane} refs {' '.join(map(str, refs))}", flush=True)
        for mode in ("on_policy", "async") if lifetime else ():
            cfg = load_config(recipe, ["trainer.data_plane=object_store", f"trainer.run_dir={Path(out) / mode}",
                                       f"trainer.steps={lifetime}", f"trainer.mode={mode}", "data.prompts_per_step=1",
                                       "algorithm.kl_coef=0.0", "trainer.max_staleness=0"])
            group.reuse_for(cfg)
            counts = {"ranks": [], "controller": [], "engines": []}

            def count(g, step: int) -> None:
                counts["ranks"].append(sum(g._all("object_refs")))
                counts["controller"].append(reference_count())
                counts["engines"].append(sum(g.fleet.call_all("object_refs")))

            train(cfg, group=group, after_sync=count)
            count(group, lifetime + 1)
            print(f"life {mode} " + " ".join(f"{k} {' '.join(map(str, v))}" for k, v in counts.items()), flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    steps = int(args.pop(args.index("--lifetime") + 1)) if "--lifetime" in args else 0
    args = [a for a in args if a != "--lifetime"]
    main(args[0], args[1], steps)
