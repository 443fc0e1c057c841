"""Render the Kubernetes manifests from deploy/: one source of truth for the application and its dashboard.

    python -m deploy.k8s render     # (make k8s) copy each source into its manifest block
    python -m deploy.k8s check      # exit 1 when a manifest has drifted from its source

Two blocks are copied in, as the verbatim text of their source (comments included):
k8s/rayservice.yaml's `serveConfigV2: |` := deploy/cluster-gpu.yaml, and k8s/grafana-dashboard.yaml's
`specserve-dashboard.json: |` := deploy/grafana/specserve-dashboard.json. Everything else in k8s/
(pod groups, probes, Services, labels) is edited by hand.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SERVE_CONFIG = REPO / "deploy" / "cluster-gpu.yaml"
RAYSERVICE = REPO / "k8s" / "rayservice.yaml"
KEY = "serveConfigV2: |"
DASHBOARD = REPO / "deploy" / "grafana" / "specserve-dashboard.json"
DASHBOARD_CONFIGMAP = REPO / "k8s" / "grafana-dashboard.yaml"


@dataclass(frozen=True)
class Block:
    """A manifest whose `key: |` block is the text of `source`."""

    manifest: Path
    key: str
    source: Path

    def rendered(self) -> str:
        return render(self.manifest.read_text(), self.source.read_text(), self.key)


BLOCKS = (Block(RAYSERVICE, KEY, SERVE_CONFIG), Block(DASHBOARD_CONFIGMAP, "specserve-dashboard.json: |", DASHBOARD))


def render(manifest: str, source: str, key: str = KEY) -> str:
    """`manifest` with its `key` block (a YAML literal block) replaced by `source`, indented under the key."""
    lines = manifest.splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip() == key]
    if len(starts) != 1:
        raise ValueError(f"{key!r}: expected exactly one in the manifest, found {len(starts)}")
    start = starts[0]
    indent = len(lines[start]) - len(lines[start].lstrip())
    end = start + 1
    while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > indent):
        end += 1
    while end > start + 1 and not lines[end - 1].strip():  # blank lines after the block stay
        end -= 1
    pad = " " * (indent + 2)
    block = [pad + line if line.strip() else "" for line in source.rstrip("\n").splitlines()]
    return "\n".join(lines[: start + 1] + block + lines[end:]) + "\n"


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def rendered() -> str:
    """k8s/rayservice.yaml as `make k8s` writes it."""
    return BLOCKS[0].rendered()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.k8s", description="Render k8s/ from deploy/.")
    parser.add_argument("action", choices=["render", "check"])
    args = parser.parse_args(argv)
    drifted = 0
    for block in BLOCKS:
        text, manifest, source = block.rendered(), block.manifest.relative_to(REPO), block.source.relative_to(REPO)
        if args.action == "render":
            block.manifest.write_text(text)
            print(f"{manifest}: {block.key.split(':')[0]} = {source}")
        elif text != block.manifest.read_text():
            print(f"{manifest} differs from {source}: run `make k8s`")
            drifted = 1
    return drifted


if __name__ == "__main__":
    sys.exit(main())
