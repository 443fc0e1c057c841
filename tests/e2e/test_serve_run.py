"""`serve run deploy/local.yaml`, the first line of that YAML's comment, on the 2-core machine it is written for.

Ray Serve's own CLI, as a user types it: it starts a local Ray sized by this machine's cores, schedules the draft,
target and router replicas of the shipped YAML (only its HTTP port is moved), and the official `openai` client is
answered, streamed and not, with speculation at work. Ctrl-C (SIGINT) stops it with every process it started.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import openai
import psutil
import pytest
import yaml

from tests.actors.serve_helpers import free_port, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]
LOCAL_YAML = REPO / "deploy" / "local.yaml"
MESSAGES = [{"role": "user", "content": "Write a Python function that returns the square of a number."}]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[openai.OpenAI, subprocess.Popen[bytes], Path]]:
    root = tmp_path_factory.mktemp("serve-run")
    config = yaml.safe_load(LOCAL_YAML.read_text())
    port = free_port()
    config["http_options"]["port"] = port  # the one change: 8000 may be taken on a test machine
    path = root / "local.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    log_path = root / "serve-run.log"
    serve_cli = shutil.which("serve")
    assert serve_cli, "Ray Serve's CLI (`serve`) is installed with ray[serve]"
    ray_temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths (<= 107 bytes) live under it
    # unbuffered: the log shows how far a slow shutdown got when the Ctrl-C test fails
    env = {**os.environ, "RAY_TMPDIR": ray_temp, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    # `serve run` starts with SIGINT's default disposition, as a terminal's command does: a test runner started in
    # the background (`pytest ... &` in a script) ignores SIGINT, its children inherit that, and Ctrl-C would never
    # reach `serve run`.
    runner_sigint = signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        with log_path.open("w") as log:
            server = subprocess.Popen(
                [serve_cli, "run", str(path)],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
    finally:
        signal.signal(signal.SIGINT, runner_sigint)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120, max_retries=0)

    def answers() -> bool:
        assert server.poll() is None, f"serve run exited {server.returncode}: {log_path.read_text()[-3000:]}"
        try:
            return [m.id for m in client.models.list().data] == ["qwen-1.5b"]
        except openai.APIError:
            return False

    try:
        assert wait_until(answers, 420, every_s=3), f"/v1/models never answered: {log_path.read_text()[-3000:]}"
        yield client, server, log_path
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)
        shutil.rmtree(ray_temp, ignore_errors=True)


def test_serve_run_of_the_shipped_yaml_answers_the_openai_client(
    served: tuple[openai.OpenAI, subprocess.Popen[bytes], Path],
) -> None:
    client, _, _ = served
    whole = client.chat.completions.create(model="qwen-1.5b", messages=MESSAGES, max_tokens=24, temperature=0)  # type: ignore[arg-type]
    text = whole.choices[0].message.content
    assert text and whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 24
    usage = whole.usage.model_dump()
    assert usage["accepted_tokens"] > 0, f"speculation at work: {usage}"
    stream = client.chat.completions.create(
        model="qwen-1.5b",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=24,
        temperature=0,
        stream=True,
    )
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == text


def test_ctrl_c_stops_serve_run_and_every_process_it_started(
    served: tuple[openai.OpenAI, subprocess.Popen[bytes], Path],
) -> None:
    _, server, log_path = served
    run = psutil.Process(server.pid).children(recursive=True)
    assert run, "Ray's processes and the replicas"
    server.send_signal(signal.SIGINT)
    assert server.wait(timeout=180) == 0, log_path.read_text()[-3000:]
    _, alive = psutil.wait_procs(run, timeout=30)
    assert not alive, [(p.pid, p.name()) for p in alive]
