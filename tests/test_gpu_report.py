"""The GPU check's machinery on the CPU: offline wheel installation, JUnit parsing, report writing,
per-part time limits counted from each part's start, `partial` benchmark parts, the schedule
(scripts/gpu_check.sh --cpu-smoke), the strict exit status (a run that saw no CUDA device, or ran
fewer `gpu` tests than there are, fails), the rehearsal's verdict, and that the `gpu` tests collect
with exactly the GPU image's missing packages unimportable. Nothing here needs or fakes a GPU."""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from helpers import REPO, cli_env

sys.path.insert(0, str(REPO / "benchmarks"))
from gpu_check import image, orchestrate, report, verdict  # noqa: E402


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
    s = report.junit_summary(p)
    assert (s["passed"], s["failed"], s["errors"], s["skipped"]) == (1, 1, 1, 1)
    assert s["failures"][0]["test"] == "tests.test_gpu_flex::test_b" and "3.1e-02" in s["failures"][0]["message"]
    assert s["skips"] == {"needs Transformer Engine": 1}
    assert s["cases"][2] == {"test": "tests.test_gpu_train::test_c", "outcome": "skipped",
                             "reason": "needs Transformer Engine"}
    assert report.junit_summary(tmp_path / "none.xml") == {"found": False}
    with pytest.raises(SystemExit, match="PART=SECONDS"):
        orchestrate.parse_limits(["bogus=3"], orchestrate.GPU_LIMITS)


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
    assert train["predicted_ms"] > 0 and train["measured_over_predicted"] > 0 and "prediction_note" in train
    decode = [row for row in parts["decode"]["rows"] if "tokens_per_s" in row]
    assert {(row["sampler"], row["mode"], row["batch"]) for row in decode} == {
        (s, m, b) for s in ("SetDLM w=4 thr=off", "AR") for m in ("compiled", "eager") for b in (1, 4)}
    assert [(r["sampler"], r["mode"], r["batch"]) for r in decode[:2]] == [
        ("SetDLM w=4 thr=off", "compiled", 4), ("AR", "compiled", 4)]  # what matters most runs first
    assert all(row["tokens_per_s"] > 0 and row["tokens_per_step"] == 1.0 for row in decode)
    assert rep["cuda"]["visible"] is False
    assert rep["verdict"][:2] == ["part install: failed", "part env: timeout"], rep["verdict"]
    assert rep["verdict"][2].startswith("CUDA is not visible"), rep["verdict"]
    md = (out / "report.md").read_text()
    assert "CPU SMOKE RUN" in md and "| env | timeout |" in md and "## Decoding throughput" in md
    assert "## Predicted vs measured step time" in md
    assert "## Verdict: FAILED" in md and "- part env: timeout" in md
    log = (out / "gpu_check.log").read_text()
    assert "time limit 2s reached" in log and os.path.getsize(out / "report.md") > 500
    assert "budget left" in log


def _junit(path: Path, skip: dict | None = None, fail: str | None = None) -> Path:
    """A JUnit file with every expected gpu test (verdict.GPU_TESTS), passed unless `skip` (test id ->
    reason) or `fail` (a test id) says otherwise."""
    skip = skip or {}
    cases = []
    for file, n in verdict.GPU_TESTS.items():
        module = file[:-len(".py")].replace("/", ".")
        names = [f"test_{i}" for i in range(n)]
        if file == "tests/test_gpu_train.py":
            names[-1] = "test_fp8_forward_backward_tracks_bf16"
        for name in names:
            tid, body = f"{module}::{name}", ""
            if tid in skip:
                body = f'<skipped message="{skip[tid]}"/>'
            elif tid == fail:
                body = '<failure message="AssertionError: off by one">x</failure>'
            cases.append(f'<testcase classname="{module}" name="{name}" time="1.0">{body}</testcase>')
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{"".join(cases)}</testsuite></testsuites>')
    return path


def _verdict(tmp_path, cuda=True, parts=("env", "tests"), smoke=False, **junit) -> list[str]:
    rep = {"parts": {p: {"status": "ok"} for p in parts}, "cuda": {"visible": cuda}}
    if "tests" in parts:
        rep["tests"] = {**report.junit_summary(_junit(tmp_path / "t.xml", **junit)),
                        "selection": orchestrate.selection(smoke)}
    return verdict.verdict(rep)


FP8 = "tests.test_gpu_train::test_fp8_forward_backward_tracks_bf16"


def test_the_verdict_passes_only_when_cuda_was_seen_and_every_gpu_test_ran(tmp_path):
    total = sum(verdict.GPU_TESTS.values())
    assert _verdict(tmp_path) == []
    assert _verdict(tmp_path, skip={FP8: "model.fp8=hybrid: Transformer Engine is not installed (...)"}) == []
    assert _verdict(tmp_path, parts=("env", "train")) == []  # no tests part: nothing expected of it
    assert _verdict(tmp_path, cuda=False) == ["CUDA is not visible (torch.cuda.is_available() is False)"]
    assert _verdict(tmp_path, skip={"tests.test_gpu_flex::test_3": "needs a CUDA GPU (none is visible)"}) == [
        f"only {total - 1} of {total} gpu tests ran; skipped: needs a CUDA GPU (none is visible)"]
    # FP8 may skip for want of Transformer Engine only, not for any reason
    assert _verdict(tmp_path, skip={FP8: "model.fp8=hybrid: H100 (compute capability 8.0) has no FP8 tensor cores"}) == [
        f"only {total - 1} of {total} gpu tests ran; skipped: model.fp8=hybrid: H100 (compute capability 8.0) has no "
        "FP8 tensor cores"]
    assert _verdict(tmp_path, fail="tests.test_gpu_decode::test_0") == ["gpu tests: 1 failed, 0 errors"]
    rep = {"parts": {"tests": {"status": "timeout"}}, "cuda": {"visible": True}, "tests": {"found": False}}
    assert verdict.verdict(rep) == ["part tests: timeout", "the tests part wrote no JUnit file"]
    assert verdict.expected_tests(orchestrate.selection(True)) == (
        verdict.GPU_TESTS["tests/test_gpu_decode.py"] + verdict.GPU_TESTS["tests/test_gpu_train.py"])


def _image_env(tmp_path) -> dict:
    """The environment of a process that cannot import what the GPU image lacks (gpu_check/image.py)."""
    image.write_blocker(tmp_path / "blocker")
    env = cli_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "blocker")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def test_the_blocker_hides_exactly_the_image_s_missing_packages(tmp_path):
    probe = ("import importlib, importlib.util, importlib.metadata as md, json, sys\n"
             "out = {}\n"
             "for dist, mod in json.loads(sys.argv[1]).items():\n"
             "    try:\n"
             "        importlib.import_module(mod); out[mod] = 'imported'\n"
             "    except ModuleNotFoundError:\n"
             "        out[mod] = 'spec' if importlib.util.find_spec(mod) else 'hidden'\n"
             "    try:\n"
             "        md.version(dist); out[dist + ' (dist)'] = 'found'\n"
             "    except md.PackageNotFoundError:\n"
             "        pass\n"
             "import torch, yaml, pytest\n"
             "out['torch'] = md.version('torch')\n"
             "print(json.dumps(out))\n")
    r = subprocess.run([sys.executable, "-c", probe, json.dumps(image.MISSING)], env=_image_env(tmp_path),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out.pop("torch") and out == {mod: "hidden" for mod in image.MISSING.values()}


@pytest.mark.slow
def test_the_gpu_tests_collect_on_the_image_s_packages_and_match_the_table(tmp_path):
    """With exactly the GPU image's missing packages unimportable, `pytest -m gpu --collect-only tests`
    collects every `gpu` test and has no collection error; per file it finds what verdict.GPU_TESTS says
    (so adding a gpu test means adding it there), and the tests part's selection is those files."""
    r = subprocess.run([sys.executable, "-m", "pytest", "tests", "-m", "gpu", "--collect-only", "-q", "-p",
                        "no:cacheprovider"], cwd=REPO, env=_image_env(tmp_path), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "error" not in r.stdout.splitlines()[-1].lower(), r.stdout[-3000:]
    files = [line.split("::")[0] for line in r.stdout.splitlines() if "::" in line]
    assert {f: files.count(f) for f in files} == verdict.GPU_TESTS
    assert len(files) == sum(verdict.GPU_TESTS.values())
    assert orchestrate.selection(False) == sorted(verdict.GPU_TESTS)


@pytest.mark.slow
def test_a_cpu_run_of_the_gpu_tests_exits_1_naming_why(tmp_path):
    """The tests part on the CPU: every gpu test skips, pytest exits 0, and the check still fails."""
    out = tmp_path / "out"
    r = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--cpu-smoke", "--parts", "tests"],
                       cwd=REPO, env={**cli_env(), "OUT": str(out), "PYTHON": sys.executable}, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads((out / "report.json").read_text())
    n = verdict.expected_tests(orchestrate.selection(True))
    assert rep["parts"]["tests"]["status"] == "ok" and rep["tests"]["passed"] == 0 and rep["tests"]["skipped"] == n
    assert rep["verdict"][0].startswith("CUDA is not visible"), rep["verdict"]
    assert rep["verdict"][1].startswith(f"only 0 of {n} gpu tests ran; skipped: needs a CUDA GPU"), rep["verdict"]
    assert "## Verdict: FAILED" in (out / "report.md").read_text()
    assert "FAILED: only 0 of" in (out / "gpu_check.log").read_text()


def _part(tmp_path, name, code, limit):
    log = orchestrate.Log(tmp_path / "log.txt")
    cmd = [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(REPO / 'benchmarks')!r})\n{code}", "--deadline-at"]
    return orchestrate.run_part(name, cmd, limit, {**os.environ, "PYTHONUNBUFFERED": "1"}, log, lambda: 99.0)


ROW = "from gpu_check.rows import emit, Deadline\n"


def test_a_benchmark_part_out_of_time_after_some_rows_is_partial(tmp_path):
    """The part's deadline is a wall-clock time set as its process starts; rows it printed before its
    limit are kept; a benchmark part stopped after measuring is `partial`, one stopped with nothing
    measured is `timeout`, and one that skipped rows for want of time itself is `partial` too."""
    code = ROW + ("import time\nleft = float(sys.argv[-1]) - time.time()\n"
                  "emit({'sampler': 'x', 'tokens_per_s': 1.0, 'left': left})\ntime.sleep(60)")
    # a limit the part's start-up (Python, the import) cannot use up on a loaded 2-core machine: 3 s once did
    res = _part(tmp_path, "decode", code, 10)
    assert res["status"] == "partial" and "1 measured rows" in res["reason"], res
    assert 0.0 < res["rows"][0]["left"] <= 10.0 and res["seconds"] < 25
    res = _part(tmp_path, "train", "import time\ntime.sleep(60)", 2)
    assert res["status"] == "timeout" and "reason" not in res
    res = _part(tmp_path, "tests", ROW + "emit({'tokens_per_s': 1.0})\nimport time\ntime.sleep(60)", 2)
    assert res["status"] == "timeout"  # the tests part is never partial
    code = ROW + "emit({'tokens_per_s': 1.0})\nemit({'cut': True, 'note': 'not run'})"
    res = _part(tmp_path, "decode", code, 30)
    assert res["status"] == "partial" and res["reason"] == "1 rows measured, 1 not run: out of time"
    res = _part(tmp_path, "decode", ROW + "emit({'tokens_per_s': 1.0})\nsys.exit(1)", 30)
    assert res["status"] == "failed"


def test_the_schedule_passes_unused_time_on_and_the_gpu_run_fits_8_minutes():
    assert orchestrate.schedule(["install", "tests", "decode"], {"install": 30, "tests": 150, "decode": 95}) == {
        "install": 30, "tests": 180, "decode": 275}
    total = orchestrate.GPU_BUDGET + orchestrate.GRACE + 10  # + the CUDA probe's interpreter start
    assert sum(orchestrate.GPU_LIMITS.values()) <= orchestrate.GPU_BUDGET and total <= 480


def test_partial_benchmarks_pass_and_the_rehearsal_verdict(tmp_path):
    total = sum(verdict.GPU_TESTS.values())
    rep = {"parts": {"train": {"status": "partial"}, "decode": {"status": "partial"}}, "cuda": {"visible": True}}
    assert verdict.verdict(rep) == []
    no_cuda = "needs a CUDA GPU (none is visible)"
    skip_all = {f"{f[:-3].replace('/', '.')}::test_{i}": no_cuda for f, n in verdict.GPU_TESTS.items() for i in range(n)}
    skip_all["tests.test_gpu_train::test_fp8_forward_backward_tracks_bf16"] = no_cuda

    def rehearsal(parts=("install", "env", "tests", "train"), status="ok", **junit):
        rep = {"parts": {p: {"status": status if p == "train" else "ok"} for p in parts}, "cuda": {"visible": False},
               "tests": {**report.junit_summary(_junit(tmp_path / "r.xml", **junit)),
                         "selection": orchestrate.selection(False)}}
        return verdict.rehearsal_verdict(rep)

    assert rehearsal(skip=skip_all) == []
    assert rehearsal(status="partial", skip=skip_all) == []
    assert rehearsal(status="timeout", skip=skip_all) == ["part train: timeout"]
    some = dict(skip_all)
    some["tests.test_gpu_flex::test_2"] = "needs flex attention"
    assert rehearsal(skip=some) == ["gpu tests skipped for another reason than no CUDA: needs flex attention"]
    bad = {k: v for k, v in skip_all.items() if k != "tests.test_gpu_decode::test_0"}
    assert rehearsal(skip=bad, fail="tests.test_gpu_decode::test_0")[0].startswith("gpu tests: 1 failed, 0 errors")
    rep = {"parts": {"tests": {"status": "ok"}}, "tests": {"found": True, "passed": 0, "failed": 0, "errors": 0,
                                                           "skipped": total - 2, "cases": [], "failures": [],
                                                           "selection": orchestrate.selection(False)}}
    assert verdict.rehearsal_verdict(rep) == [f"{total - 2} gpu tests collected, {total} expected (verdict.GPU_TESTS)"]


def test_the_train_part_predicts_each_case_with_the_dry_run_s_model():
    """benchmarks/gpu_check/predict.py: the step time of pretrain/steptime.py on the preset of the device
    the case ran on (H100 / H200 by name), the H200's rates with a note elsewhere."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from gpu_check.predict import predicted, ratio
    from pretrain.config import load_config
    from pretrain.hardware import PRESETS, preset_of_device
    from pretrain.steptime import step_time

    cfg = load_config(None, ["model.preset=paper-12x768", "model.vocab_size=50258", "model.mask_id=50257",
                             "data.seq_len=1024", "model.max_seq_len=1024", "train.micro_batch=16",
                             "train.global_batch=16", "parallel.zero_stage=1"])
    h100 = predicted(cfg, "NVIDIA H100 80GB HBM3", "bf16", cuda=True)
    assert h100["hardware"] == "H100 SXM" and "prediction_note" not in h100
    assert h100["predicted_ms"] == round(1000 * step_time(cfg, 1, PRESETS["h100"]).total, 1)
    h200 = predicted(cfg, "NVIDIA H200", "bf16", cuda=True)
    assert h200["hardware"] == "H200 SXM" and h200["predicted_ms"] < h100["predicted_ms"]  # faster HBM
    cpu = predicted(cfg, None, "fp32", cuda=False)
    assert cpu["hardware"] == "H200 SXM" and "no preset" in cpu["prediction_note"]
    assert [preset_of_device(n) for n in ("NVIDIA H100 PCIe", "NVIDIA GH200 480GB", "NVIDIA A100-SXM4-80GB")] == [None] * 3
    assert ratio(120.0, 100.0) == 1.2 and ratio(None, 100.0) is None
