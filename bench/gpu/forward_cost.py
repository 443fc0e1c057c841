"""The cost of one target forward over q new tokens, eager and replayed as a CUDA graph.

Our runner's verify step is one `transformers` forward over q tokens with a 4D mask over a cached
context. At batch 1 on a large GPU that forward is bound by launching ~30 kernels per layer from
Python, not by the GPU; capturing the same forward once as a CUDA graph and replaying it removes
the launches and keeps the kernels, so its logits must be identical to the eager ones. The
difference between the two times is what a graph-captured runner would gain per step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device, reps: int, warmup: int = 2) -> float:
    """Median seconds of one call, device work included."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


class ForwardAtContext:
    """One forward of q new tokens in each of `batch` rows after a prefilled context, repeatable: the
    cache is reset each call."""

    def __init__(self, model: PreTrainedModel, context: int, q: int, seed: int = 0, batch: int = 1) -> None:
        self.model, self.base, self.head = model, model.base_model, model.get_output_embeddings()
        device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        gen = torch.Generator().manual_seed(seed)
        vocab = model.config.vocab_size
        prompt = torch.randint(0, vocab, (batch, context), generator=gen)
        self.cache = DynamicCache(config=model.config)
        with torch.no_grad():
            self.base(input_ids=prompt.to(device), cache=self.cache, use_cache=True)
        self.layers: list[Any] = list(self.cache.layers)
        self.saved = [(layer.keys, layer.values) for layer in self.layers]
        self.ids = torch.randint(0, vocab, (batch, q), generator=gen).to(device)  # [B, q]
        self.positions = (context + torch.arange(q))[None].expand(batch, q).to(device)  # [B, q]
        allowed = torch.ones(q, context + q, dtype=torch.bool).tril(context)  # causal over context + new
        zero, low = torch.zeros((), dtype=dtype), torch.finfo(dtype).min
        self.mask = torch.where(allowed, zero, low)[None, None].to(device)  # [1, 1, q, context + q]

    @torch.no_grad()
    def __call__(self) -> torch.Tensor:  # [B, q, V] logits
        for layer, (keys, values) in zip(self.layers, self.saved, strict=True):
            layer.keys, layer.values = keys, values  # back to the context: every call sees the same cache
        out = self.base(
            input_ids=self.ids, position_ids=self.positions, attention_mask=self.mask, cache=self.cache, use_cache=True
        )
        return self.head(out.last_hidden_state)


def capture(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """`fn` captured as a CUDA graph: returns a replay that fills the same output tensor."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm-up off the default stream, as torch.cuda.graphs requires
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay


def dry_capture(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """No graph: `fn` itself. Runs every line around a capture where there is no CUDA (--tiny)."""
    return fn


CAPTURES = {"cuda": capture, "dry": dry_capture}


def graph_row(forward: ForwardAtContext, device: torch.device, reps: int, graphs: str) -> dict[str, Any]:
    """Graph-replay time of `forward` and how its logits compare with eager ones."""
    eager_logits = forward().float()  # [1, q, V]
    replay = CAPTURES[graphs](forward)
    graph_ms = timed(replay, device, reps) * 1e3
    graph_logits = replay().float()  # [1, q, V]
    return {
        "graph_ms": graph_ms,
        "graph_max_abs_diff": float((graph_logits - eager_logits).abs().max()),
        "graph_argmax_equal": bool((graph_logits.argmax(-1) == eager_logits.argmax(-1)).all()),
    }


def forward_costs(
    model: PreTrainedModel, context: int, qs: list[int], reps: int, graphs: str, deadline: float
) -> list[dict[str, Any]]:
    """Per q: eager seconds and, unless graphs == "off", graph-replay seconds and whether logits match."""
    device = next(model.parameters()).device
    rows = []
    for q in qs:
        if time.monotonic() > deadline:
            break
        forward = ForwardAtContext(model, context, q)
        row: dict[str, Any] = {"q": q, "eager_ms": timed(forward, device, reps) * 1e3}
        if graphs != "off":
            try:
                row.update(graph_row(forward, device, reps, graphs))
            except Exception as error:  # report it, keep the eager figures, stop trying graphs
                row["graph_error"] = f"{type(error).__name__}: {error}"
                graphs = "off"
        rows.append(row)
        print(f"  forward q={q:3d}: {row}", flush=True)
    base = rows[0]["eager_ms"] if rows else 1.0
    for row in rows:
        row["eager_vs_q1"] = row["eager_ms"] / base
    return rows
