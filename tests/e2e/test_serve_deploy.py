"""`serve deploy deploy/cluster.yaml` onto a `ray start --head` cluster with token authentication on.

The documented operator flow, end to end: `ray start --head --block` (its own token, temp dir and
ports, in its own process group), `serve deploy` of the cluster YAML (tiny models, fractional
CPUs), `serve status` until RUNNING, then the OpenAI HTTP API and gRPC answer with the target's
own greedy tokens, `serve shutdown -y`, and exactly that cluster is stopped (its process group).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import tempfile
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
import yaml

from proto import specserve_pb2 as pb
from proto import specserve_pb2_grpc as pb_grpc
from tests.actors.conftest import shm_op_built  # noqa: F401 (a fixture)
from tests.actors.serve_helpers import APP, WORKER_ENV, deploy_yaml, small_cpu_args, wait_until
from tests.e2e.test_front_doors import GREEDY, free_port, reference
from tests.front_router import MODEL_NAME, save_tiny_pair

# tp_size 2 (cluster.yaml): DeepSpeed's CPU all-reduce op is compiled once before the cluster starts.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.usefixtures("shm_op_built")]
PROMPT = [7, 8, 9, 10, 11, 7, 8]


class Head:
    """A `ray start --head --block` cluster in its own process group, with token auth on."""

    def __init__(self, root: Path) -> None:
        self.ports = {name: free_port() for name in ("gcs", "dashboard", "agent", "client", "metrics", "http", "grpc")}
        self.dashboard = f"http://127.0.0.1:{self.ports['dashboard']}"
        self.token = uuid.uuid4().hex
        self.api_key = f"sk-{uuid.uuid4().hex}"  # cluster.yaml's front_door.api_key_env reads it on every node
        self.env = {**os.environ, **WORKER_ENV, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token}
        self.env["SPECSERVE_API_KEY"] = self.api_key
        self.log = (root / "ray-start.log").open("w")
        self.temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths live under it
        command = ["ray", "start", "--head", "--block", "--disable-usage-stats", f"--temp-dir={self.temp_dir}"]
        command += ["--num-cpus=4", "--resources", json.dumps({"draft_node": 1, "target_node": 1})]
        command += ["--include-dashboard=true", "--dashboard-host=127.0.0.1"]
        for flag, port in [
            ("port", "gcs"),
            ("dashboard-port", "dashboard"),
            ("dashboard-agent-listen-port", "agent"),
            ("ray-client-server-port", "client"),
            ("metrics-export-port", "metrics"),
        ]:
            command.append(f"--{flag}={self.ports[port]}")
        self.process = subprocess.Popen(
            command, env=self.env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def serve(self, *args: str) -> subprocess.CompletedProcess[str]:
        """The `serve` CLI against this cluster's dashboard, authenticated with its token."""
        command = ["serve", *args, "--address", self.dashboard]
        return subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=120)

    def dashboard_status(self, token: str | None) -> int:
        request = urllib.request.Request(self.dashboard + "/api/serve/applications/")
        if token is not None:
            request.add_header("Authorization", f"Bearer {token}")
        try:
            return int(urllib.request.urlopen(request, timeout=10).status)
        except urllib.error.HTTPError as err:
            return err.code
        except OSError:
            return 0

    def stop(self) -> None:
        """SIGTERM to the whole process group (GCS, raylet, dashboard, workers), SIGKILL what remains."""
        for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            wait_until(lambda: not _group_alive(self.process.pid), wait_s)
        self.process.wait(timeout=10)
        self.log.close()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Head]:
    root = tmp_path_factory.mktemp("cluster")
    cluster = Head(root)
    try:
        assert wait_until(lambda: cluster.dashboard_status(cluster.token) == 200, 120, every_s=1), (
            root / "ray-start.log"
        ).read_text()[-3000:]
        yield cluster
    finally:
        cluster.stop()
    assert not _group_alive(cluster.process.pid)


def app_status(head: Head) -> str:
    status = head.serve("status")
    if status.returncode != 0:
        return f"serve status failed: {status.stderr[-500:]}"
    return str((yaml.safe_load(status.stdout) or {}).get("applications", {}).get(APP, {}).get("status"))


def test_serve_deploy_runs_and_answers_over_http_and_grpc(head: Head, tmp_path: Path) -> None:
    """cluster.yaml serves gRPC (every interface) with the key from $SPECSERVE_API_KEY; the same file with no key
    is refused at deploy, naming the reason and the fix."""
    assert head.dashboard_status(token=None) == 401, "token authentication must be on"
    target, draft, _ = save_tiny_pair(tmp_path)
    config: dict[str, Any] = deploy_yaml("cluster.yaml", small_cpu_args(target, draft, MODEL_NAME))
    config["http_options"] = {"host": "127.0.0.1", "port": head.ports["http"]}
    config["grpc_options"]["port"] = head.ports["grpc"]
    path = tmp_path / "cluster.yaml"
    open_door = yaml.safe_load(yaml.safe_dump(config))
    for key in ("api_key_env", "open"):  # as a user's file without a key would be
        open_door["applications"][0]["args"]["front_door"].pop(key, None)
    path.write_text(yaml.safe_dump(open_door))
    assert head.serve("deploy", str(path)).returncode == 0  # accepted, then built by the controller
    assert wait_until(lambda: app_status(head) == "DEPLOY_FAILED", 120, every_s=2), app_status(head)
    status = head.serve("status").stdout
    assert "refusing to serve without an API key" in status and "gRPC listens on every interface" in status, status

    path.write_text(yaml.safe_dump(config))
    deployed = head.serve("deploy", str(path))
    assert deployed.returncode == 0, deployed.stderr
    assert wait_until(lambda: app_status(head) == "RUNNING", 300, every_s=3), app_status(head)

    expected = reference(tmp_path, PROMPT)
    base_url = f"http://127.0.0.1:{head.ports['http']}/v1"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=base_url, api_key=head.api_key, max_retries=0)
    done = client.completions.create(model=MODEL_NAME, prompt=PROMPT, **GREEDY)
    assert done.choices[0].model_extra["token_ids"] == expected
    assert asyncio.run(grpc_generate(f"127.0.0.1:{head.ports['grpc']}", head.api_key)) == expected

    shutdown = head.serve("shutdown", "-y")
    assert shutdown.returncode == 0, shutdown.stderr
    assert wait_until(lambda: app_status(head) != "RUNNING", 60, every_s=2)


async def grpc_generate(address: str, key: str) -> list[int]:
    request = pb.GenerateRequest(
        model=MODEL_NAME,
        token_ids=pb.TokenIds(ids=PROMPT),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=GREEDY["max_tokens"], ignore_eos=True),
    )
    async with grpc.aio.insecure_channel(address) as channel:
        metadata = (("application", APP), ("authorization", f"Bearer {key}"))
        reply = await pb_grpc.SpecServeStub(channel).Generate(request, metadata=metadata)
    return list(reply.token_ids)
