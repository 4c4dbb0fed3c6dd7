"""`ling-serve`'s start: the port refused before anything loads; one start of a random tiny preset (`--preset`)
read line by line from its stderr pipe: it listens at once, answers 503 while it loads, prints its warm-up
progress, and answers 200 the moment it prints `ready`."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading

import pytest
from helpers import ONE_DEVICE_XLA_FLAGS, REPO_ROOT
from optional_deps import require_serve_extra

require_serve_extra()
httpx = pytest.importorskip("httpx", reason="the server tests' client (the test extra)")

from ling_jax.serving import cli  # noqa: E402
from ling_jax.serving.cli import main  # noqa: E402

START_TIMEOUT_S = 300


@pytest.fixture
def no_loading(monkeypatch):
    monkeypatch.setattr(cli, "load_model", lambda *a, **k: pytest.fail("the model loaded before the port check"))


def test_port_in_use_is_one_error_line_before_loading(no_loading, capsys):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert main(["--port", str(port)]) == 2
    assert capsys.readouterr().err == (
        f"error: --port {port}: 127.0.0.1:{port} is in use (another server?); pick another --port\n"
    )


def test_port_out_of_range_is_one_error_line(no_loading, capsys):
    assert main(["--port", "99999"]) == 2
    assert capsys.readouterr().err == "error: --port must be in 0..65535, got 99999\n"


def test_missing_tokenizer_names_no_flag_ling_serve_lacks(tmp_path, capsys):
    for name in ("config.json", "model-00001-of-00001.safetensors", "model.safetensors.index.json"):
        (tmp_path / name).symlink_to(cli.DEMO_DIR / name)
    assert main(["--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'tokenizer.json'}: missing") and "--byte-tokenizer" not in err


def test_health_is_503_while_loading_and_200_once_ready():
    # one slot and one decode step a program: three programs (a prefill chunk, a decode step, the first token), none
    # left compiling in the background after `ready`; one device and the faster-compiling emitters, as a CLI run
    command = [sys.executable, "-m", "ling_jax.serving", "--preset", "tiny", "--port", "0", "--max-batch", "1"]
    command += ["--max-context", "64", "--prefill-chunk", "16", "--decode-steps", "1"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "XLA_FLAGS": ONE_DEVICE_XLA_FLAGS}
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(START_TIMEOUT_S, process.kill)  # a hung start ends the pipe, and the test
    watchdog.start()
    try:
        first = process.stderr.readline()
        assert first.startswith("ling-serve: listening on http://127.0.0.1:"), first
        url = first.split()[3]
        loading = httpx.get(url + "/health", timeout=10)
        assert (loading.status_code, loading.json()) == (503, {"status": "loading"})
        refused = httpx.get(url + "/v1/models", timeout=10)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "loading"
        lines = []
        for line in process.stderr:  # the pipe gets every phase's line as it happens
            lines.append(line)
            if line.startswith("ling-serve: ready"):
                break
        assert lines[-1] == f"ling-serve: ready: tiny on {url}/v1\n", "".join(lines)
        assert httpx.get(url + "/health", timeout=10).json() == {"status": "ok"}  # at once, no retry
        assert any("warm-up: compiled 1 of " in line for line in lines)
        metrics = httpx.get(url + "/metrics", timeout=10).text
        phases = dict(re.findall(r'^ling_serve_startup_seconds\{phase="(\w+)"\} (\S+)$', metrics, re.M))
        load, warm_up, ready = (float(phases[phase]) for phase in ("load", "warm_up", "ready"))
        assert 0 < load and 0 < warm_up and load + warm_up < ready, phases  # the metrics time the start's phases
        body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2}
        assert json.loads(httpx.post(url + "/v1/completions", json=body, timeout=60).text)["usage"] == {
            "prompt_tokens": 3,
            "completion_tokens": 2,
            "total_tokens": 5,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        process.terminate()
        assert process.wait(timeout=60) == 0
    finally:
        watchdog.cancel()
        if process.poll() is None:
            process.kill()
            process.wait()
