"""Captured forwards: the runner's forward at fixed shapes over a fixed KV cache, compiled whole.

On a GPU a forward launched op by op from Python costs several times what the same kernels cost
replayed as one CUDA graph (bench/results/gpu.md: 28.0 ms eager vs 7.1 ms replayed, an 8B target).
A graph replays fixed shapes at fixed addresses, so this runner differs from `ModelRunner` in how a
forward runs, never in what it computes:

- the KV cache is made once, `rows` slots of `columns` columns plus one scratch slot, and never
  grows (`FixedCache`: a request past it is an error, sized by the replica's budget up front);
- a forward of B rows adding up to n tokens each runs at the bucket (rows, tokens) just above
  (`Buckets`), padded: pad rows and pad tokens write their keys into the scratch slot and their
  queries see nothing of another row; attention covers all `columns` columns, masked;
- each bucket has its own input buffers (tokens, positions, mask, write index) at fixed addresses,
  filled from the host once per forward, and its own compiled step: `torch.compile(fullgraph=True,
  dynamic=False)` of a copy of the step function with a code object of its own, so dynamo keeps one
  graph per bucket and never recompiles one for another (on CUDA in mode "reduce-overhead": the
  graph is replayed as a CUDA graph). Forwards larger than every bucket (long prefill chunks) run
  the same step uncompiled.

How a bucket is captured (`Compiler`): on CUDA by default `cuda_graphs`, the eager step recorded as a
`torch.cuda.CUDAGraph` (seconds per bucket at a replica's start, where inductor takes minutes per
bucket for an 8B stack: a start of dozens of buckets would take an hour); `inductor` adds fused
kernels where a longer start pays. What makes either possible is checked on the CPU: every bucket's
step compiles whole through dynamo (`fullgraph=True`: no graph break, no host sync inside, on tiny
Llama and Qwen2 models in CI), the capture CUDA graphs need.

The step is the stack of `lean_stack` (Llama, Qwen2) with attention as one SDPA call over the fixed
cache; other architectures are refused at construction (`graphs: auto` then keeps `ModelRunner`).
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from speculative.engine.kv_cache import PREALLOCATED_ROWS, PREALLOCATED_TOKENS, Shape, SlotCache, bucketed
from speculative.engine.kv_pool import KvPool
from speculative.engine.lean_stack import lean_stack, run_layers
from speculative.engine.runner import ModelRunner, Step

logger = logging.getLogger(__name__)

TREE_ROOM = 64  # columns a fixed cache keeps past the window it advertises: a round's speculative tokens
Compiler = Callable[[Callable[..., torch.Tensor]], Callable[..., torch.Tensor]]


@dataclass(frozen=True)
class Buckets:
    """The (rows, tokens) shapes forwards are captured at: a forward runs at the smallest that holds it."""

    rows: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    tokens: tuple[int, ...] = (1, 2, 4, 8, 16, 32)

    def of(self, batch: int, n: int) -> tuple[int, int] | None:
        """The bucket of a forward of `batch` rows adding up to `n` tokens each; None: larger than all."""
        rows = next((r for r in self.rows if r >= batch), None)
        tokens = next((t for t in self.tokens if t >= n), None)
        return None if rows is None or tokens is None else (rows, tokens)

    def within(self, rows: int) -> Buckets:
        """The buckets a cache of `rows` slots serves (row buckets past it would attend missing slots)."""
        fits = tuple(r for r in self.rows if r <= rows)
        return Buckets(fits if fits[-1:] == (rows,) else (*fits, rows), self.tokens)

    def all(self) -> list[tuple[int, int]]:
        return [(r, t) for r in self.rows for t in self.tokens]


class FixedCache(SlotCache):
    """A `SlotCache` made at its full size for every layer up front (fixed addresses), plus a scratch slot
    where pads write; it never grows."""

    def __init__(self, config: Any, rows: int, columns: int, layers: list[tuple[int, int]], like: torch.Tensor) -> None:
        """`layers`: per layer, (kv_heads, head_dim); `like`: a tensor of the cache's dtype and device."""
        super().__init__(config)
        self.slots, self.capacity = rows, bucketed(columns)
        for i, (kv_heads, dim) in enumerate(layers):
            for store in (self.keys, self.values):  # slot `rows` is the scratch slot
                store[i] = like.new_zeros(rows + 1, self.capacity, kv_heads, dim)
                if like.is_cuda:
                    torch._dynamo.mark_static_address(store[i])  # graphs read it in place

    def reserve(self, rows: int, cols: int) -> None:
        if rows > self.slots or cols > self.capacity:
            raise ValueError(
                f"{rows} rows x {cols} columns do not fit the captured KV cache "
                f"({self.slots} rows x {self.capacity} columns, fixed at start)"
            )

    def cells(self) -> int:
        return (self.slots + 1) * self.capacity  # the scratch slot's too

    @property
    def scratch(self) -> int:
        """`Write.index` of a pad's key and value: the scratch slot, never attended."""
        return self.slots * self.capacity


@dataclass(frozen=True)
class _Inputs:
    """One bucket's input buffers, at fixed addresses; R rows, N tokens, C cache columns."""

    tokens: torch.Tensor  # [R * N] int64
    positions: torch.Tensor  # [R * N] int64
    mask: torch.Tensor  # [R, 1, N, C] additive, the model's dtype
    index: torch.Tensor  # [R * N] int64: where each token's key and value go (`FixedCache`)

    @staticmethod
    def make(rows: int, tokens: int, columns: int, dtype: torch.dtype, device: torch.device) -> _Inputs:
        made = _Inputs(
            torch.zeros(rows * tokens, dtype=torch.long, device=device),
            torch.zeros(rows * tokens, dtype=torch.long, device=device),
            torch.zeros(rows, 1, tokens, columns, dtype=dtype, device=device),
            torch.zeros(rows * tokens, dtype=torch.long, device=device),
        )
        if device.type == "cuda":
            for t in (made.tokens, made.positions, made.mask, made.index):
                torch._dynamo.mark_static_address(t)
        return made

    def fill(self, tokens: np.ndarray, positions: np.ndarray, mask: torch.Tensor, index: np.ndarray) -> None:
        """Copy one forward's inputs in (host to device; nothing comes back)."""
        self.tokens.copy_(torch.from_numpy(tokens.reshape(-1)), non_blocking=True)
        self.positions.copy_(torch.from_numpy(positions.reshape(-1)), non_blocking=True)
        self.mask.copy_(mask, non_blocking=True)
        self.index.copy_(torch.from_numpy(index.reshape(-1)), non_blocking=True)


def default_compiler(device: torch.device) -> Compiler:
    """CUDA: `cuda_graphs` (seconds per bucket at start); elsewhere inductor (`torch.compile`, fullgraph)."""
    if device.type == "cuda":
        return cuda_graphs()
    return lambda fn: torch.compile(fn, fullgraph=True, dynamic=False)


def inductor(device: torch.device) -> Compiler:
    """torch.compile with inductor, on CUDA in mode "reduce-overhead" (its graphs replayed as CUDA graphs): fused
    norms, rotary and activations, for minutes of compiling per bucket at start."""
    mode = "reduce-overhead" if device.type == "cuda" else None
    return lambda fn: torch.compile(fn, fullgraph=True, dynamic=False, mode=mode)


def cuda_graphs() -> Compiler:
    """Each bucket's step recorded once as a `torch.cuda.CUDAGraph` (after two warm-up runs on a side stream)
    and replayed: the eager kernels without a launch from Python each. Every graph shares one memory pool
    (one forward runs at a time, and its output is gathered before the next replays)."""
    pool: list[Any] = [None]

    def capture(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        graph: torch.cuda.CUDAGraph | None = None
        out: torch.Tensor | None = None

        def replay(*inputs: torch.Tensor) -> torch.Tensor:
            nonlocal graph, out
            if graph is None:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(2):  # lazy initialisations (cuBLAS workspaces) outside the recording
                        fn(*inputs)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool[0]):
                    out = fn(*inputs)
                pool[0] = graph.pool()
            graph.replay()
            assert out is not None
            return out

        return replay

    return capture


def backend_compiler(backend: str) -> Compiler:
    """The same capture through another dynamo backend ("aot_eager": traced whole and functionalized, no code
    generated: what CI checks on the CPU in seconds; "eager": traced only)."""
    return lambda fn: torch.compile(fn, fullgraph=True, dynamic=False, backend=backend)


class CapturedRunner(ModelRunner):
    """`ModelRunner` whose forwards run as captured per-bucket graphs over a fixed KV cache."""

    def __init__(
        self,
        model: Any,
        rows: int,
        columns: int,
        buckets: Buckets = Buckets(),
        compiler: Compiler | None = None,
        pool: KvPool | None = None,
    ) -> None:
        """`rows` x `columns`: the KV cache, fixed (most sequences, most tokens each, trees included), taken
        whole from `pool` (`KvPool.take`: KvPoolFull where it has no room). `compiler`: how each bucket's step
        is compiled (`default_compiler` of the model's device)."""
        super().__init__(model, pool=pool)
        stack = lean_stack(self._base)
        if stack is None:
            raise ValueError(f"{type(self._base).__name__}: captured forwards know Llama and Qwen2 stacks only")
        stack_layers: Any = self._base.layers
        layers = [(a.config.num_key_value_heads, a.head_dim) for a in (layer.self_attn for layer in stack_layers)]
        like = torch.empty(0, dtype=self.dtype, device=self.device)
        self._granted([(rows + 1, bucketed(columns))])  # the whole cache, its scratch slot too, or KvPoolFull
        self.cache = self.fixed = FixedCache(model.config, rows, columns, layers, like)
        self.buckets = buckets.within(rows)
        self._step = _step_function(self._base, self.fixed)
        self._compiler = compiler or default_compiler(self.device)
        self._graphs: dict[tuple[int, int], tuple[_Inputs, Callable[..., torch.Tensor]]] = {}

    @torch.no_grad()  # as every forward runs: grad mode is part of what a graph is guarded on
    def capture(self, report: Callable[[str], None] = logger.info) -> None:
        """Compile every bucket now (a replica's start), with a line of progress per bucket."""
        shapes = self.buckets.all()
        for i, (rows, tokens) in enumerate(shapes):
            inputs, step = self._graph(rows, tokens)
            inputs.index.fill_(self.fixed.scratch)  # a dry run: every write to the scratch slot
            inputs.mask.fill_(torch.finfo(self.dtype).min)
            step(inputs.tokens, inputs.positions, inputs.mask, inputs.index)
            report(f"captured forward {i + 1}/{len(shapes)}: {rows} rows x {tokens} tokens")

    def _graph(self, rows: int, tokens: int) -> tuple[_Inputs, Callable[..., torch.Tensor]]:
        found = self._graphs.get((rows, tokens))
        if found is None:
            inputs = _Inputs.make(rows, tokens, self.cache.capacity, self.dtype, self.device)
            found = self._graphs[(rows, tokens)] = (inputs, self._compiler(_own_code(self._step, rows, tokens)))
        return found

    def _room(self, rows: int, cols: int) -> None:
        self.cache.reserve(rows, cols)  # fixed: a ValueError past it

    def trim(self) -> None:
        """Nothing: the graphs write the fixed cache in place."""

    def _execute(self, step: Step) -> torch.Tensor:  # [T, H]
        batch, n = step.tokens.shape
        columns = self.cache.capacity
        self.cache.reserve(batch, self.width + step.start + n)
        bucket = self.buckets.of(batch, n)
        rows, tokens = bucket if bucket is not None else (batch, bucketed(n))
        padded = np.zeros((rows, tokens), dtype=bool)  # [R, N]: a row's own token
        padded[:batch, :n] = step.valid
        index = np.full((rows, tokens), self.fixed.scratch, dtype=np.int64)  # [R, N]
        cell_rows, cell_columns = step.cells(self.lens)
        index[padded] = cell_rows * columns + cell_columns  # `SlotCache.index`, on the host
        mask = torch.full((rows, 1, tokens, columns), torch.finfo(self.dtype).min, dtype=self.dtype)
        mask[:batch, :, :n] = self._attention_mask(step.start, n, columns)
        token_ids, positions = (np.zeros((rows, tokens), dtype=np.int64) for _ in range(2))
        token_ids[:batch, :n], positions[:batch, :n] = step.tokens, step.positions
        if bucket is None:  # larger than every bucket (a long prefill chunk): the same step, uncompiled
            inputs = _Inputs.make(rows, tokens, columns, self.dtype, self.device)
            run: Callable[..., torch.Tensor] = self._step
        else:
            inputs, run = self._graph(rows, tokens)
        inputs.fill(token_ids, positions, mask, index)
        hidden = run(inputs.tokens, inputs.positions, inputs.mask, inputs.index)  # [R * N, H]
        picked = torch.from_numpy(np.flatnonzero(padded)).to(self.device)  # [T] the rows' own tokens, packed
        return hidden[picked]  # a copy: a replayed graph's output is overwritten by its next replay


def _step_function(base: Any, cache: FixedCache) -> Callable[..., torch.Tensor]:
    """The stack's forward at one bucket's shapes: tokens, positions, index [R * N], mask [R, 1, N, C] ->
    last hidden states [R * N, H]; keys and values written in place into `cache`'s buffers."""
    keys = [cache.keys[i] for i in range(len(base.layers))]
    values = [cache.values[i] for i in range(len(base.layers))]
    scaling = [layer.self_attn.scaling for layer in base.layers]

    def step(tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        rows, per_row = mask.shape[0], mask.shape[2]

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # -> [T, heads * D]
            for buf, new in ((keys[i], k), (values[i], v)):  # [1, kv, T, D] -> the cache's [slots * C, kv, D]
                buf.view(-1, *buf.shape[2:]).index_copy_(0, index, new[0].transpose(0, 1))
            queries = q[0].view(q.shape[1], rows, per_row, -1).transpose(0, 1)  # [R, heads, N, D]
            seen = (keys[i][:rows].transpose(1, 2), values[i][:rows].transpose(1, 2))  # [R, kv, C, D] each
            o = F.scaled_dot_product_attention(queries, *seen, attn_mask=mask, scale=scaling[i], enable_gqa=True)
            return o.transpose(1, 2).reshape(rows * per_row, -1)  # [R, heads, N, D] -> [T, heads * D]

        with torch.no_grad():
            return run_layers(base, tokens, positions, attend)

    return step


def _own_code(fn: Callable[..., torch.Tensor], rows: int, tokens: int) -> Callable[..., torch.Tensor]:
    """`fn` with a code object of its own: dynamo keeps compiled graphs per code object, so each bucket's
    copy holds exactly its one graph (no recompiling one bucket's graph for another's shapes)."""
    assert isinstance(fn, types.FunctionType)
    code = fn.__code__.replace(co_name=f"step_{rows}x{tokens}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def graphs_on(graphs: str, model: Any) -> bool:
    """Whether `graphs` (auto | on | off) captures `model`'s forwards: auto where they run on CUDA and the
    stack is one `CapturedRunner` knows; on: wherever asked (an unknown stack is an error)."""
    if graphs == "off":
        return False
    known = lean_stack(model.base_model) is not None
    if graphs == "on" and not known:
        raise ValueError(f"graphs: 'on', but {type(model.base_model).__name__} is not a Llama or Qwen2 stack")
    return known and (graphs == "on" or next(model.parameters()).device.type == "cuda")


def runner_for(
    model: Any,
    graphs: str = "off",
    reserve: Shape | None = None,
    lean: bool = False,
    compiler: Compiler | None = None,
    pool: KvPool | None = None,
) -> ModelRunner:
    """The runner of a replica's model: a `CapturedRunner` over a cache of `reserve` (rows, columns), its
    buckets compiled here, where `graphs_on`; else a `ModelRunner` (growing from `reserve`). Either draws its
    cache from `pool`, the process's KV pool (None: unbounded)."""
    if not graphs_on(graphs, model):
        return ModelRunner(model, reserve, lean=lean, pool=pool)
    rows, columns = reserve if reserve is not None else (PREALLOCATED_ROWS, PREALLOCATED_TOKENS // PREALLOCATED_ROWS)
    runner = CapturedRunner(model, rows, columns, compiler=compiler, pool=pool)
    runner.capture()
    return runner
