"""`--device` is one shared check (common/device.py) in `setdlm sample`, `eval` and `serve`: a name
torch does not know, or a device this build or machine lacks, is one line with exit status 2 before
anything is loaded or written (serve's own cases are in test_serve_process.py)."""

import pytest
import torch

from helpers import setdlm

MISSING = "cuda:99" if torch.cuda.is_available() else "cuda"


@pytest.mark.slow
@pytest.mark.parametrize("command", [["sample", "--prompt", "x"], ["eval", "likelihood"]])
def test_bogus_device_is_one_line_with_status_2(tmp_path, command):
    out = tmp_path / "out"
    args = [*command, "--checkpoint", str(tmp_path / "missing"), "--device", "bogus"]
    if command[0] == "eval":
        args += ["--out", str(out)]
    r = setdlm(*args, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    prog = " ".join(command[:1] if command[0] == "sample" else command)
    assert r.stderr.strip().splitlines() == [
        f"setdlm {prog}: error: --device bogus: not a torch device (cpu, cuda, cuda:N)"]
    assert not out.exists()


def test_missing_device_is_refused_before_any_work(tmp_path, capsys):
    from eval import api
    from eval.errors import EvalError
    from eval.sample import main as sample

    assert sample(["--checkpoint", str(tmp_path / "missing"), "--prompt", "x", "--device", MISSING]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"setdlm sample: error: --device {MISSING}: ")
    with pytest.raises(EvalError, match=f"^--device {MISSING}: "):
        api.run("likelihood", checkpoint=str(tmp_path / "missing"), out=str(tmp_path / "out"), device=MISSING)
    assert not (tmp_path / "out").exists()


def test_check_device_names_what_is_usable():
    from common.device import check_device
    from common.errors import UsageError

    check_device(None)
    check_device("cpu")
    for bad, why in [("bogus", "not a torch device"), ("", "not a torch device"), ("mps", "no mps device")]:
        with pytest.raises(UsageError, match=f"^--device {bad}: {why}"):
            check_device(bad)
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match=r"^--device cuda:1: this torch \S+ has no CUDA; use --device cpu$"):
            check_device("cuda:1")
