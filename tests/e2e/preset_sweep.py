"""Every ``algorithm.name`` preset through the whole loop on ONE set of workers and engines
(tests/e2e/test_algorithms_e2e.py runs it as a subprocess).

``python preset_sweep.py RECIPE OUT_DIR NAME [NAME ...]``: builds one WorkerGroup from the first
preset's config (pf_ppo first: its critic is then there for every preset that needs one), then
runs ``megarl.driver.loop.train`` of each preset on it (:meth:`WorkerGroup.reuse_for`), each in
``OUT_DIR/NAME``; prints ``done NAME`` after each and exits 0 when all ran.
"""
import sys
from pathlib import Path

from megarl.config import load_config
from megarl.driver.loop import train
from megarl.actors.group import WorkerGroup


def main(recipe: str, out: str, names: list[str]) -> None:
    configs = [load_config(recipe, [f"algorithm.name={name}", f"trainer.run_dir={Path(out) / name}"])
               for name in names]
    (Path(out) / "logs").mkdir(parents=True, exist_ok=True)
    with WorkerGroup(configs[0], Path(out) / "logs") as group:
        for name, cfg in zip(names, configs):
            train(cfg, group=group)
            print(f"done {name}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
