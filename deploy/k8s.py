"""Render the Kubernetes manifests from the Serve config: one source of truth for the application.

    python -m deploy.k8s render     # (make k8s) k8s/rayservice.yaml's serveConfigV2 := deploy/cluster-gpu.yaml
    python -m deploy.k8s check      # exit 1 when k8s/rayservice.yaml has drifted from it

Everything else in k8s/rayservice.yaml (pod groups, probes, Services) is edited by hand; only the
`serveConfigV2: |` block is replaced, as the verbatim text of the Serve config (comments included).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SERVE_CONFIG = REPO / "deploy" / "cluster-gpu.yaml"
RAYSERVICE = REPO / "k8s" / "rayservice.yaml"
KEY = "serveConfigV2: |"


def render(manifest: str, serve_config: str) -> str:
    """`manifest` with its `serveConfigV2: |` block replaced by `serve_config`, indented under the key."""
    lines = manifest.splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip() == KEY]
    if len(starts) != 1:
        raise ValueError(f"{KEY!r}: expected exactly one in the manifest, found {len(starts)}")
    start = starts[0]
    indent = len(lines[start]) - len(lines[start].lstrip())
    end = start + 1
    while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > indent):
        end += 1
    while end > start + 1 and not lines[end - 1].strip():  # blank lines after the block stay
        end -= 1
    pad = " " * (indent + 2)
    block = [pad + line if line.strip() else "" for line in serve_config.rstrip("\n").splitlines()]
    return "\n".join(lines[: start + 1] + block + lines[end:]) + "\n"


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def rendered() -> str:
    return render(RAYSERVICE.read_text(), SERVE_CONFIG.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.k8s", description="Render k8s/ from deploy/.")
    parser.add_argument("action", choices=["render", "check"])
    args = parser.parse_args(argv)
    text = rendered()
    if args.action == "render":
        RAYSERVICE.write_text(text)
        print(f"{RAYSERVICE.relative_to(REPO)}: serveConfigV2 = {SERVE_CONFIG.relative_to(REPO)}")
        return 0
    if text != RAYSERVICE.read_text():
        print(f"{RAYSERVICE.relative_to(REPO)} differs from {SERVE_CONFIG.relative_to(REPO)}: run `make k8s`")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
