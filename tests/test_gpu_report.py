"""The GPU check's machinery on the CPU: offline wheel installation, JUnit parsing, report writing and
per-part time limits (scripts/gpu_check.sh --cpu-smoke). Nothing here needs or fakes a GPU."""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from helpers import REPO, cli_env

sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_report  # noqa: E402


def _wheel(folder: Path, name: str, version: str, requires=(), tag="py3-none-any") -> Path:
    """A minimal valid wheel holding one module `<name>_mod` (pure Python)."""
    dist = f"{name}-{version}.dist-info"
    path = folder / f"{name}-{version}-{tag}.whl"
    meta = "Metadata-Version: 2.1\nName: {}\nVersion: {}\n{}".format(
        name, version, "".join(f"Requires-Dist: {r}\n" for r in requires))
    files = {f"{name}_mod/__init__.py": f"VERSION = {version!r}\n", f"{dist}/METADATA": meta,
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{dist}/RECORD"] = "".join(f"{n},,\n" for n in files) + f"{dist}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for n, text in files.items():
            z.writestr(n, text)
    return path


def _install(*args):
    return subprocess.run([sys.executable, str(REPO / "scripts" / "install_wheels.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=300)


def test_install_wheels_takes_only_what_is_missing_offline(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "alpha", "1.0", ["beta>=2", "pytest", "beta<9; python_version < '3'"])
    _wheel(wheels, "beta", "2.1")
    _wheel(wheels, "beta", "1.5")  # too old for alpha: never chosen
    _wheel(wheels, "pytest", "0.1")  # the installed pytest meets alpha's need: the carried one stays unused
    _wheel(wheels, "gamma", "1.0", tag="cp27-cp27m-manylinux1_x86_64")  # built for another Python
    site, report = tmp_path / "site", tmp_path / "install.json"
    r = _install("--wheels", wheels, "--target", site, "--report", report, "alpha")
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(report.read_text())
    assert [(i["name"], i["version"]) for i in rep["installed"]] == [("alpha", "1.0"), ("beta", "2.1")]
    assert "pytest" in rep["present"]
    assert (site / "alpha_mod" / "__init__.py").is_file() and (site / "beta_mod").is_dir()
    assert not (site / "pytest_mod").exists()
    # Run again: now present in the target, nothing more is installed.
    r = _install("--wheels", wheels, "--target", site, "--report", report, "alpha")
    assert r.returncode == 0 and json.loads(report.read_text())["installed"] == []
    # A need no wheel here can meet, and a wheel for another Python, are errors naming them.
    r = _install("--wheels", wheels, "--target", tmp_path / "s2", "--dry-run", "delta", "gamma")
    assert r.returncode == 1
    assert "delta" in r.stderr and "no wheel" in r.stderr and "gamma" in r.stderr and "do not fit" in r.stderr
    r = _install("--wheels", wheels, "--target", tmp_path / "s2", "--dry-run", "--skip-incompatible", "gamma")
    assert r.returncode == 0 and "SKIPPED" in r.stdout
    # The machine's torch is never replaced, even when a carried wheel would meet a need it fails.
    _wheel(wheels, "torch", "99.0")
    r = _install("--wheels", wheels, "--target", tmp_path / "s3", "--dry-run", "torch>=99")
    assert r.returncode == 1 and "never replaced" in r.stderr


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.test_gpu_flex" name="test_a[cuda-bf16]" time="1.0"/>
<testcase classname="tests.test_gpu_flex" name="test_b" time="1.0"><failure message="AssertionError: flex bf16 relative error 3.1e-02">long</failure></testcase>
<testcase classname="tests.test_gpu_train" name="test_c" time="0.0"><skipped message="needs Transformer Engine"/></testcase>
<testcase classname="tests.test_x" name="" time="0.0"><error message="collection failure">x</error></testcase>
</testsuite></testsuites>"""


def test_junit_summary(tmp_path):
    p = tmp_path / "t.xml"
    p.write_text(JUNIT)
    s = gpu_report.junit_summary(p)
    assert (s["passed"], s["failed"], s["errors"], s["skipped"]) == (1, 1, 1, 1)
    assert s["failures"][0]["test"] == "tests.test_gpu_flex::test_b" and "3.1e-02" in s["failures"][0]["message"]
    assert s["skips"] == {"needs Transformer Engine": 1}
    assert gpu_report.junit_summary(tmp_path / "none.xml") == {"found": False}
    with pytest.raises(SystemExit, match="PART=SECONDS"):
        gpu_report.parse_limits(["bogus=3"], gpu_report.GPU_LIMITS)


@pytest.mark.slow
def test_cpu_smoke_writes_the_report_and_enforces_time_limits(tmp_path):
    """gpu_check.sh --cpu-smoke: install pointed at a missing folder (fails, naming it), env stopped at
    a 2 s limit, train and decode with tiny shapes; the report is complete and names each outcome."""
    out = tmp_path / "out"
    env = {**cli_env(), "OUT": str(out)}
    r = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--cpu-smoke", "--parts",
                        "install,env,train,decode", "--limit", "env=2", "--wheels", str(tmp_path / "nowheels"),
                        "--site", str(tmp_path / "site")],
                       cwd=REPO, env={**env, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=900)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]  # env ran out of time, install had no folder
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.log", "report.json", "report.md"]
    rep = json.loads((out / "report.json").read_text())
    parts = rep["parts"]
    assert rep["smoke"] is True and list(parts) == ["install", "env", "train", "decode"]
    assert parts["install"]["status"] == "failed" and "--wheels" in "".join(parts["install"]["tail"])
    assert parts["env"]["status"] == "timeout" and parts["env"]["seconds"] < 40
    assert parts["train"]["status"] == "ok" and parts["decode"]["status"] == "ok", (parts["train"], parts["decode"])
    (train,) = parts["train"]["rows"]
    assert train["objective"] == "setdlm" and train["tokens_per_s"] > 0 and train["timed_steps"] == 2
    assert train["loss"] > 1.0 and train["mfu"] is None  # no peak on a CPU: MFU is not invented
    decode = [row for row in parts["decode"]["rows"] if "tokens_per_s" in row]
    assert {(row["sampler"], row["batch"]) for row in decode} == {
        ("SetDLM w=4 thr=off", 1), ("SetDLM w=4 thr=off", 4), ("AR", 1), ("AR", 4)}
    assert all(row["tokens_per_s"] > 0 and row["tokens_per_step"] == 1.0 for row in decode)
    md = (out / "report.md").read_text()
    assert "CPU SMOKE RUN" in md and "| env | timeout |" in md and "## Decoding throughput" in md
    log = (out / "gpu_check.log").read_text()
    assert "time limit 2s reached" in log and os.path.getsize(out / "report.md") > 500
