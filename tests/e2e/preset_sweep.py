"""Every ``algorithm.name`` preset through the whole loop on ONE set of workers and engines
(tests/e2e/test_algorithms_e2e.py runs it as a subprocess).

``python preset_sweep.py RECIPE OUT_DIR ENTRY [ENTRY ...]``: an ENTRY is a preset NAME (run with
RECIPE and ``algorithm.name=NAME``) or ``NAME=RECIPE_FILE`` (a recipe of its own, e.g. with more
steps, an evaluation and a checkpoint folder); each runs in ``OUT_DIR/NAME``, in order. One
WorkerGroup is built from the first entry whose algorithm needs a critic (else the first entry),
so the critic is there for every entry that needs one; each entry then runs
``megarl.driver.loop.train`` on it (:meth:`WorkerGroup.reuse_for`). Prints ``done NAME`` after
each and exits 0 when all ran.
"""
import sys
from pathlib import Path

from megarl.actors.algorithm import needs_critic
from megarl.actors.group import WorkerGroup
from megarl.config import load_config
from megarl.driver.loop import train


def main(recipe: str, out: str, entries: list[str]) -> None:
    names, configs = [], []
    for entry in entries:
        name, _, own = entry.partition("=")
        overrides = [f"trainer.run_dir={Path(out) / name}"] + ([] if own else [f"algorithm.name={name}"])
        names.append(name)
        configs.append(load_config(own or recipe, overrides))
    (Path(out) / "logs").mkdir(parents=True, exist_ok=True)
    build = next((c for c in configs if needs_critic(c.algorithm)), configs[0])
    with WorkerGroup(build, Path(out) / "logs") as group:
        for name, cfg in zip(names, configs):
            train(cfg, group=group)
            print(f"done {name}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
