"""`setdlm serve` as its own process: SIGTERM drains the running request and exits 0; the API key is
required and never appears in what the server prints."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from helpers import REPO, cli_env
from serve_helpers import train_tiny

KEY = "sk-proc-8c1b2f77a9"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, model_parallel):
    return train_tiny(tmp_path_factory.mktemp("serve_proc"))


def start(run_dir, tmp_path):
    out, err = open(tmp_path / "out.log", "w"), open(tmp_path / "err.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "launch.cli", "serve", "--checkpoint", str(run_dir), "--port", "0",
                             "--max-batch", "2", "--api-key", KEY, "--device", "cpu"],
                            cwd=REPO, env=cli_env(), stdout=out, stderr=err)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        for line in (tmp_path / "out.log").read_text().splitlines():
            if "listening on http://" in line:
                return proc, line.split("listening on ")[1].split()[0]
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"no listening line: {(tmp_path / 'err.log').read_text()[-2000:]}")


@pytest.mark.slow
def test_sigterm_drains_and_the_key_is_never_logged(run_dir, tmp_path):
    proc, url = start(run_dir, tmp_path)
    try:
        assert url.startswith("http://127.0.0.1:")  # loopback unless told otherwise
        auth = {"Authorization": f"Bearer {KEY}"}
        body = {"prompt": "A class", "max_tokens": 4, "temperature": 0}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 401
        assert httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer x"},
                          timeout=60).status_code == 401
        assert httpx.post(url + "/v1/completions", json=body, headers=auth, timeout=60).status_code == 200
        first, chunks = threading.Event(), []

        def long_stream():  # 60 tokens, one per step: still running when SIGTERM comes
            long = {"prompt": "Lists implement", "max_tokens": 60, "temperature": 0, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=long, headers=auth, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        chunks.append(line[6:])
                        first.set()

        t = threading.Thread(target=long_stream)
        t.start()
        assert first.wait(60)
        proc.send_signal(signal.SIGTERM)
        t.join(120)
        assert chunks[-1] == "[DONE]"  # the running request finished
        final = json.loads(chunks[-2])["choices"][0]
        assert final["finish_reason"] == "length" and len(final["setdlm"]["tokens"]) == 60
        assert proc.wait(60) == 0
        with pytest.raises(httpx.ConnectError):  # and it stopped listening
            httpx.post(url + "/v1/completions", json=body, headers=auth, timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out, err = (tmp_path / "out.log").read_text(), (tmp_path / "err.log").read_text()
    assert "setdlm serve: stopped" in out and "running finish first" in err
    assert '"POST /v1/completions HTTP/1.1" 401' in err and '"POST /v1/completions HTTP/1.1" 200' in err
    assert KEY not in out + err and KEY[3:] not in out + err
    assert os.environ.get("SETDLM_API_KEY") is None or os.environ["SETDLM_API_KEY"] not in out + err


@pytest.mark.parametrize("flag, value, message", [
    ("--max-total-tokens", "1", "--max-total-tokens must be >= 2, got 1"),
    ("--max-batch", "0", "--max-batch must be >= 1, got 0"),
    ("--port", "70000", "--port must be in [0, 65535], got 70000"),
])
def test_bad_serve_options_are_one_line_before_any_load(tmp_path, flag, value, message):
    """Checked before the checkpoint is read (it does not exist here): exit status 2, one line, no traceback."""
    r = subprocess.run([sys.executable, "-m", "launch.cli", "serve", "--checkpoint", str(tmp_path / "missing"),
                        flag, value], cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in r.stderr, r.stderr
