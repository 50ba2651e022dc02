"""Layout-invariance worker: trains tiny runs through the real Trainer, one after another, in one launch.

    torchrun --standalone --nproc-per-node N tests/layout_worker.py RECIPE OUT NAME:OVERRIDE,OVERRIDE ...

Each NAME:OVERRIDES trains the recipe with `run.name=NAME run.out_dir=OUT` and the comma-separated
overrides (tests/test_layout_invariance.py compares the runs' metrics and checkpoints).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from pretrain.parallel import ensure_process_group
    from pretrain.config import load_config
    from pretrain.trainer import Trainer

    recipe, out, *runs = sys.argv[1:]
    ensure_process_group()
    for run in runs:
        name, _, overrides = run.partition(":")
        cfg = load_config(Path(recipe), [f"run.name={name}", f"run.out_dir={out}", *filter(None, overrides.split(","))])
        Trainer(cfg).train()
    return 0


if __name__ == "__main__":
    sys.exit(main())
