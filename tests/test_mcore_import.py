"""pretrain/mcore.py imports megatron-core without its start-up costs the stack never uses, and leaves
nothing changed behind it: `torch.compile` is torch's own again, and `wandb` (hidden from megatron-core's
inference modules for that import only) imports as usual afterwards."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(code: str) -> str:
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout.strip()


def test_megatron_import_skips_wandb_and_restores_both():
    out = _run(
        "import sys, torch\n"
        "compile_before = torch.compile\n"
        "import pretrain.mcore\n"
        "from megatron.core.inference.contexts import dynamic_context\n"
        "assert torch.compile is compile_before\n"
        "print('wandb' in sys.modules, dynamic_context.HAVE_WANDB)\n"
        "import wandb\n"
        "print(callable(wandb.init))\n")
    assert out.split() == ["False", "False", "True"]


def test_wandb_imported_first_is_left_alone():
    out = _run(
        "import wandb, sys\n"
        "import pretrain.mcore\n"
        "from megatron.core.inference.contexts import dynamic_context\n"
        "print(sys.modules['wandb'] is wandb, dynamic_context.HAVE_WANDB)\n")
    assert out.split() == ["True", "True"]
