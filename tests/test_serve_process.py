"""`setdlm serve` as its own process: SIGTERM drains the running request and exits 0; the API key is
required and never appears in what the server prints."""

import json
import os
import re
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


def start(run_dir, tmp_path, pipe: bool = False):
    """The server process and its URL; `pipe`: stdout is a pipe that this process reads (proc.stdout)."""
    out, err = subprocess.PIPE if pipe else open(tmp_path / "out.log", "w"), open(tmp_path / "err.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "launch.cli", "serve", "--checkpoint", str(run_dir), "--port", "0",
                             "--max-batch", "2", "--api-key", KEY, "--device", "cpu"],
                            cwd=REPO, env=cli_env(), stdout=out, stderr=err, text=True)
    for line in proc.stdout if pipe else ():  # the server prints this line once it listens (or ends, and the pipe)
        if "listening on http://" in line:
            return proc, line.split("listening on ")[1].split()[0]
    deadline = time.monotonic() + 180
    while not pipe and time.monotonic() < deadline and proc.poll() is None:
        for line in (tmp_path / "out.log").read_text().splitlines():
            if "listening on http://" in line:
                return proc, line.split("listening on ")[1].split()[0]
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"no listening line: {(tmp_path / 'err.log').read_text()[-2000:]}")


@pytest.mark.slow
def test_sigterm_drains_and_the_key_is_never_logged(run_dir, tmp_path):
    """... also when nobody reads its stdout any more (the reader of its pipe has gone): it still exits
    0, with no traceback."""
    proc, url = start(run_dir, tmp_path, pipe=True)
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
        proc.stdout.close()  # a dead reader: the server's last line meets a closed pipe
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
    out, err = "", (tmp_path / "err.log").read_text()
    assert "setdlm serve: stopped" in err and "running finish first" in err and "Traceback" not in err, err[-2000:]
    assert '"POST /v1/completions HTTP/1.1" 401' in err and '"POST /v1/completions HTTP/1.1" 200' in err
    assert KEY not in out + err and KEY[3:] not in out + err
    assert os.environ.get("SETDLM_API_KEY") is None or os.environ["SETDLM_API_KEY"] not in out + err


@pytest.mark.parametrize("flag, value, message", [
    ("--max-total-tokens", "1", "--max-total-tokens must be >= 2, got 1"),
    ("--max-batch", "0", "--max-batch must be >= 1, got 0"),
    ("--port", "70000", "--port must be in [0, 65535], got 70000"),
    ("--device", "bogus", "--device bogus: not a torch device"),
])
def test_bad_serve_options_are_one_line_before_any_load(tmp_path, flag, value, message):
    """Checked before the checkpoint is read (it does not exist here): exit status 2, one line, no traceback."""
    r = subprocess.run([sys.executable, "-m", "launch.cli", "serve", "--checkpoint", str(tmp_path / "missing"),
                        flag, value], cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("flag, value, message", [
    ("--max-waiting", "-1", "--max-waiting must be >= 0, got -1"),
    ("--model-name", "", "--model-name: empty name"),
    ("--model-name", "  ", "--model-name: empty name"),
    ("--drain-timeout", "-1", "--drain-timeout must be a number of seconds >= 0, got -1"),
    ("--drain-timeout", "inf", "--drain-timeout must be a number of seconds >= 0, got inf"),
    ("--device", "cuda:99" if __import__("torch").cuda.is_available() else "cuda", "--device cuda"),
])
def test_more_bad_serve_options_before_any_load(tmp_path, flag, value, message):
    """The same checks in this process (serve.cli.main raises what `setdlm serve` prints as one line)."""
    from common.errors import UsageError
    from serve.cli import main

    with pytest.raises(UsageError, match=f"^{re.escape(message)}"):
        main(["--checkpoint", str(tmp_path / "missing"), flag, value])


def test_max_total_tokens_whose_cache_cannot_fit_is_refused_at_start(run_dir):
    r = subprocess.run([sys.executable, "-m", "launch.cli", "serve", "--checkpoint", str(run_dir), "--device", "cpu",
                        "--port", "0", "--max-total-tokens", str(10**12)], cwd=REPO, env=cli_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "listening" not in r.stdout, r.stderr
    [line] = [x for x in r.stderr.splitlines() if "error" in x]
    assert line.startswith("setdlm serve: error: --max-total-tokens 1000000000000: the KV cache of --max-batch 8 slots")
    assert "available on this host; at most" in line


@pytest.mark.parametrize("argv", [["--help"], ["--checkpoint", "x"]])
def test_without_aiohttp_one_line_even_for_help(argv):
    code = ("import sys; sys.modules['aiohttp'] = None; from launch.cli import main; "
            f"sys.exit(main(['serve', *{argv!r}]))")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=cli_env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == ("setdlm serve: error: setdlm serve needs aiohttp: pip install 'setdlm[serve]' "
                                "(or '.[serve]' in a checkout)")
