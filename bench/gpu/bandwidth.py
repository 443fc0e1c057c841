"""The memory-bandwidth bound of batch-1 decoding, and how close the measured runs come to it.

A batch-1 decode step reads every weight once, so no decoder can beat bandwidth / weight bytes
tokens per second (KV reads are small at these contexts). Bandwidth comes from the GPU's
specification (`SPEC_TB_S`, by device name), else from a measured copy on the device (a CPU, or
a GPU not in the table): e.g. an H200 (4.8 TB/s) and Llama-3.1-8B in bf16 (16.1 GB) bound it at
~299 tokens/s.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers import PreTrainedModel

SPEC_TB_S = {  # peak HBM bandwidth by a substring of torch.cuda.get_device_name(), most specific first
    "H200": 4.8,
    "H100 NVL": 3.9,
    "H100 PCIe": 2.0,
    "H100": 3.35,
    "A100-SXM4-80GB": 2.039,
    "A100": 1.555,
    "L40S": 0.864,
    "A10G": 0.6,
    "L4": 0.3,
}


def weight_bytes(model: PreTrainedModel) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def measured_copy_bytes_per_s(device: torch.device, mib: int = 256, reps: int = 5) -> float:
    """Read + write bandwidth of a large on-device copy (bytes moved per second, median)."""
    source = torch.empty(mib * 2**20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    times = []
    for _ in range(reps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        target.copy_(source)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return 2 * source.numel() / sorted(times[1:])[reps // 2]


def bandwidth(device: torch.device) -> tuple[float, str]:
    """(bytes per second, where the figure comes from)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tb_s in SPEC_TB_S.items():
            if key in name:
                return tb_s * 1e12, f"{name} specification"
    return measured_copy_bytes_per_s(device), f"measured copy on {device.type}"


def bound_section(model: PreTrainedModel) -> dict[str, Any]:
    device = next(model.parameters()).device
    per_s, source = bandwidth(device)
    weights = weight_bytes(model)
    return {
        "bandwidth_GB_s": per_s / 1e9,
        "bandwidth_source": source,
        "target_weight_MB": weights / 1e6,
        "bound_ms_per_token": weights / per_s * 1e3,
        "bound_tokens_per_s": per_s / weights,
    }


def headline(results: dict[str, Any]) -> dict[str, Any]:
    """Plain decode against the bound, speculation at oracle acceptance 0.8 against plain, and batched plain."""
    bound, target = results.get("bound") or {}, results.get("target") or {}
    out: dict[str, Any] = {}
    if "bound_tokens_per_s" in bound and "tokens_per_s" in target:
        out["plain_tokens_per_s"] = target["tokens_per_s"]
        out["plain_share_of_bound"] = target["tokens_per_s"] / bound["bound_tokens_per_s"]
    at_08 = [r for r in results.get("oracle") or [] if r.get("acceptance") == 0.8 and "speedup" in r]
    if at_08:
        best = max(at_08, key=lambda r: r["speedup"])
        out["spec_0.8_best_speedup"], out["spec_0.8_best_k"] = best["speedup"], best["k"]
    batches = [r for r in results.get("batch") or [] if "alone_tokens_per_s" in r]
    if batches:
        largest = max(batches, key=lambda r: r["batch"])
        out["batched_plain_batch"], out["batched_plain_tokens_per_s"] = largest["batch"], largest["alone_tokens_per_s"]
    return out
