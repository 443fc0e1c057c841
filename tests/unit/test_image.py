"""The Dockerfile, read (no Docker daemon needed): each variant installs from the lock, with the lock's torch from
its variant's index, and proves the install against the lock; the tag it documents for the CUDA variant is the
image k8s/ runs; its build context holds what the build reads; its model cache path is the one k8s/ mounts.
"""

from __future__ import annotations

import itertools
import re
import shlex
import tomllib
from pathlib import Path

import yaml

from deploy import lock

ROOT = lock.REPO
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def stages() -> dict[str, list[str]]:
    """stage name -> its instructions, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    out: dict[str, list[str]] = {}
    current: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("FROM "):
            current = out.setdefault(line.split()[-1], [])
        current.append(line)
    return out


def pip_installs(instructions: list[str]) -> list[list[str]]:
    """The arguments of every `pip install` the RUN instructions run (after RUN's own --mount flags)."""
    calls = []
    for line in instructions:
        if line.startswith("RUN "):
            for command in line.removeprefix("RUN ").split("&&"):
                words = list(itertools.dropwhile(lambda w: w.startswith("--mount="), shlex.split(command)))
                if words[:2] == ["pip", "install"]:
                    calls.append(words[2:])
    return calls


def documented_tags() -> dict[str, str]:
    """VARIANT -> the tag of the header's `docker build` line for it (without MODELS)."""
    tags = {}
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("#   docker build") and "MODELS" not in line:
            words = shlex.split(line.lstrip("# ").split("#")[0])
            variant = next((w.split("=")[1] for w in words if w.startswith("VARIANT=")), "cpu")
            tags[variant] = words[words.index("-t") + 1]
    return tags


def test_each_variant_installs_the_lock_with_the_locks_torch() -> None:
    torch = f"torch=={lock.read(lock.LOCK.read_text())['torch']}"
    by_stage = stages()
    for variant, index, package in (("cpu", CPU_INDEX, "/src"), ("cuda", "https://pypi.org/simple", "/src[gpu]")):
        torch_alone, install = pip_installs(by_stage[variant])
        assert torch_alone == ["--no-deps", "--index-url", index, torch], variant
        assert install == ["-c", "/src/constraints.txt", torch, package], variant
        assert any("python -m deploy.lock check" in line for line in by_stage[variant]), variant
    assert [s.split()[1] for s in by_stage["image"][:1]] == ["${VARIANT}"]
    assert "ARG VARIANT=cpu" in (ROOT / "Dockerfile").read_text()


def test_the_manifests_run_the_documented_cuda_tag() -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    tags = documented_tags()
    assert tags == {"cuda": f"specserve:{version}-gpu", "cpu": f"specserve:{version}-cpu"}
    images = set()
    for path in ("k8s/rayservice.yaml", "k8s/models.yaml"):
        images |= set(re.findall(r"^\s*image: (\S+)", (ROOT / path).read_text(), re.MULTILINE))
    assert images == {tags["cuda"]}
    service = yaml.safe_load((ROOT / "k8s" / "rayservice.yaml").read_text())
    assert service["spec"]["rayClusterConfig"]["rayVersion"] == lock.read(lock.LOCK.read_text())["ray"]


def test_the_image_has_what_kuberays_probes_run() -> None:
    """KubeRay's injected probes on a RayService worker are `bash -c "wget ... | grep success"`."""
    (apt,) = [line for line in stages()["base"] if "apt-get install" in line]
    assert {"bash", "wget"} <= set(apt.split())


def test_the_image_keeps_the_models_where_k8s_mounts_them() -> None:
    (env,) = [line for line in stages()["base"] if line.startswith("ENV ")]
    image_path = dict(pair.split("=", 1) for pair in shlex.split(env)[1:])["SPECSERVE_MODELS"]
    service = yaml.safe_load((ROOT / "k8s" / "rayservice.yaml").read_text())
    (head,) = service["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"]
    assert {e["name"]: e.get("value") for e in head["env"]}["SPECSERVE_MODELS"] == image_path
    assert any(f"install -d -o ray -g ray {image_path}" in line for line in stages()["base"])


def test_the_build_context_holds_what_the_build_reads() -> None:
    rules = [r for r in (ROOT / ".dockerignore").read_text().splitlines() if r and not r.startswith("#")]
    assert rules[0] == "*", "only what is named below it"
    kept = {r[1:] for r in rules if r.startswith("!")}
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = {p.rstrip("*") for p in find["include"]}
    assert {"pyproject.toml", "setup.py", "README.md", lock.LOCK.name} | packages <= kept
    assert Path(lock.LOCK.name) == lock.LOCK.relative_to(ROOT) and "proto/*_pb2*" in rules
