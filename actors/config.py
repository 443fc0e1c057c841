"""Configuration of each actor role: one pydantic model per component, validated at the boundary.

`deploy/config.py` composes these with per-pool resources and autoscaling into the application's
one config; the actors see only their own part.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from speculative.drafters.config import DrafterConfig, ModelDrafterConfig
from speculative.engine.loading import resolve_dtype
from speculative.planning.depth import DepthConfig

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
Quantize = Literal["none", "int8", "int4", "auto"]
CPU_QUANTIZE = ("int8", "int4")  # formats with CPU kernels only (auto resolves to none on a GPU)
CpuLinear = Literal["torch", "onednn"]
Deterministic = Literal["auto", "on", "off"]
Graphs = Literal["auto", "on", "off"]
Weights = Literal["auto", "stored", "dequantized"]

# A replica's KV budget (speculative/engine/kv_budget.py): the router admits a sequence only when its prompt
# plus max_tokens fits in what is left of it, and no window larger than it is advertised; the replica's runners
# draw their KV buffers from one pool sized to it (speculative/engine/kv_pool.py).
KvBudgetTokens = Annotated[
    int | None,
    Field(
        ge=2,
        le=1 << 32,
        description="Tokens of KV cache one replica holds over all its sequences (vLLM: num_gpu_blocks_override "
        "x block_size); None: measured at start, kv_memory_fraction of the memory free after loading the weights "
        "over the model's KV bytes per token (layers x kv_heads x head_dim x 2 x dtype bytes). Every runner of "
        "the replica's process draws its KV buffers from one pool of these tokens' bytes plus a quarter for "
        "padding rows to their group's longest (kv_budget_bytes in the router's info); a forward past it fails.",
    ),
]
KvMemoryFraction = Annotated[
    float,
    Field(
        gt=0,
        le=1,
        description="With kv_budget_tokens None: the share of the memory free after loading the weights given to "
        "KV tokens (the GPU's free memory; on a CPU the host's available memory, or less where the process's "
        "cgroup, a container's, has a memory limit: its limit less its usage). The KV pool takes a quarter more "
        "for padding; the rest is headroom for activations and other processes sharing the device.",
    ),
]

# Where a target shard runs on a CPU machine (actors/cpu_cores.py).
CpuCores = Annotated[
    tuple[Annotated[int, Field(ge=0, le=65_535)], ...] | None,
    Field(
        min_length=1,
        description="CPU cores (Linux ids) the target's shard processes run on, every thread of them, as vLLM's "
        "VLLM_CPU_OMP_THREADS_BIND; with tp_size > 1 each rank takes an equal slice in order. A local run "
        "(`make run`, the benchmarks) keeps its other processes off them, so the target's forwards are not "
        "preempted by the draft or by Ray's background threads. None: the OS places the threads. A core this "
        "machine lacks leaves the shard unpinned, with a warning.",
    ),
]


# The served model's name on every metric a replica records: the `model_name` label vLLM's metrics carry, which
# Ray Serve LLM's dashboard filters every panel by (actors/metrics.py).
MetricsModelName = Annotated[
    str,
    Field(
        max_length=256,
        description="The `model_name` label of every metric this replica records (set from the app config: "
        "front_door.served_model_name, else target_model).",
    ),
]


class ModelSettings(BaseModel):
    """How a model is held in memory and computed: what the app's models share (`AppConfig` sets it once
    for both, each `ModelConfig` carries it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dtype: Dtype = Field(
        default="auto",
        description="auto: bfloat16 where the device computes it natively (CUDA; CPUs with AVX-512 BF16 or AMX), "
        "else float32 (an AVX2 CPU emulates bf16 matmuls, slower than float32 ones); float32 for exactness tests.",
    )
    device: Literal["cpu", "cuda"] = Field(
        default="cpu",
        description="Where the weights live. Chosen by configuration, never by the GPU ids Ray assigns "
        "(a GPU may be declared to Ray without CUDA behind it). The core runner is CPU-only today.",
    )
    torch_threads: int | None = Field(
        default=None,
        ge=1,
        le=1024,
        description="torch.set_num_threads in the worker; None keeps Ray's OMP_NUM_THREADS.",
    )
    cpu_linear: CpuLinear = Field(
        default="torch",
        description="onednn: float32 Linear layers, and bfloat16 ones where oneDNN computes bfloat16 natively, "
        "through oneDNN with weights prepacked at load (speculative/engine/cpu/onednn_linear.py; CPU only; a "
        "target with tp_size 1): in float32 a forward of a few tokens costs far less than with MKL's sgemm on AMD "
        "CPUs; in bfloat16 every forward skips the weight reorder torch's Linear does per call (the same bits). "
        "Other dtypes keep torch's kernels.",
    )

    graphs: Graphs = Field(
        default="auto",
        description="Captured forwards (speculative/engine/captured.py): each (rows, tokens) bucket of the model's "
        "forward captured whole over a KV cache fixed at start, on CUDA replayed as a CUDA graph (no per-op "
        "launches from Python); captured at replica start. auto: on for a CUDA model of a Llama or Qwen2 stack "
        "(a target of tp_size 1), else off. on: also on a CPU (inductor's C++ code; minutes of compiling at "
        "start). off: op by op (the CPU's fastest path: `cpu_linear`, packed forwards, batch-invariant kernels).",
    )

    @model_validator(mode="after")
    def _onednn_on_cpu(self) -> ModelSettings:
        if self.cpu_linear == "onednn" and self.device != "cpu":
            raise ValueError("cpu_linear: 'onednn' is for device: cpu")
        return self


class ModelConfig(ModelSettings):
    """Where a model comes from, and how it is held in memory."""

    path: str = Field(
        min_length=1,
        description="A registry short name of modelstore/ (qwen-1.5b, ...), a local HF folder or a hub id.",
    )
    quantize: Quantize = Field(
        default="none",
        description="int8: the Linear layers' weights in int8, quantized at load (our AVX2 kernel for a few "
        "rows, torch's int8 kernels elsewhere: speculative/engine/cpu/int8_linear.py, CPU only), the rest in "
        "float32; int4: 4-bit weight groups (speculative/engine/cpu/int4_linear.py, CPU only): for forwards of a "
        "few tokens in a bfloat16 model where the CPU computes bfloat16 natively, else for every forward of a "
        "float32 model on the AVX2 GGUF kernel; auto: int4 on a CPU with native bfloat16 or the AVX2 kernel, int8 "
        "on other CPUs, none on a GPU. Only a draft model takes it (drafts never change output).",
    )

    weights: Weights = Field(
        default="dequantized",
        description="stored: the Linear layers on the quantized tensors of the GGUF file the model folder keeps "
        "(Q4_K, Q6_K, Q8_0; the registry's models keep theirs), read as stored by our kernels (AVX-512 VNNI, "
        "else AVX2: speculative/engine/cpu/kquant.py; other formats stay dense); auto: stored where the folder "
        "has a GGUF file and this CPU runs the kernel, else dequantized; dequantized: the weights expanded to "
        "`dtype`.",
    )

    @model_validator(mode="after")
    def _quantize_on_cpu(self) -> ModelConfig:
        if self.quantize in CPU_QUANTIZE and self.device != "cpu":
            raise ValueError(f"quantize: {self.quantize!r} runs on CPU only (torch's CPU kernels); use device: cpu")
        if self.weights == "stored" and self.device != "cpu":
            raise ValueError("weights: 'stored' runs on CPU only (its kernels are x86 CPU code); use device: cpu")
        if self.weights == "stored" and self.graphs == "on":
            raise ValueError("weights: 'stored' runs op by op (its kernel is a C call); set graphs: 'off'")
        if self.weights != "dequantized" and self.quantize != "none":
            raise ValueError("weights: stored weights are the file's own; quantize needs weights: 'dequantized'")
        return self


class DraftWorkerSettings(BaseModel):
    """A draft replica's own knobs: what the app's `draft_pool` sets for each of its replicas."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    idle_evict_s: float = Field(
        default=120.0, gt=0, le=86_400, description="Drop a lane group's caches after this long unused (a router died)."
    )
    kv_budget_tokens: KvBudgetTokens = None
    kv_memory_fraction: KvMemoryFraction = 0.5
    nice: int = Field(
        default=10,
        ge=0,
        le=19,
        description="Niceness added to the replica's process: drafts are optional work, so where the draft "
        "shares CPU cores with the target, the router or Serve's proxies (a laptop, a CPU node), they get the "
        "cores first; where each pool has its own device and cores, nothing changes.",
    )


class DraftWorkerConfig(DraftWorkerSettings):
    """One draft replica: a drafter per (router lane, micro-batch group) over one shared draft model."""

    model: ModelConfig | None = Field(
        default=None, description="The draft model; None for drafters without one (lookup)."
    )
    target_model: str = Field(min_length=1, description="The target model (for its vocabulary size only).")
    model_name: MetricsModelName = ""
    drafter: DrafterConfig = Field(
        default_factory=ModelDrafterConfig, description="The drafter kind (one that needs a draft model, or lookup)."
    )


class TargetSettings(BaseModel):
    """A target replica's own knobs: what the app's `target_pool` sets for each of its replicas."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    torch_extensions_dir: str = Field(
        default="~/.cache/specserve/torch_extensions",
        description="TORCH_EXTENSIONS_DIR of the shards: DeepSpeed compiles its CPU shared-memory all-reduce "
        "here once (~2 min on 2 cores) and every later start reuses it.",
    )
    idle_evict_s: float = Field(
        default=120.0,
        gt=0,
        le=86_400,
        description="Drop a lane group's KV cache after this long unused (a router died).",
    )
    verify_deadline_factor: float = Field(
        default=20.0,
        ge=1.0,
        le=10_000,
        description="A verify forward that runs this many times its expected seconds (its tokens at the seconds "
        "per token this replica measured) is hung: the replica's health check fails, Serve replaces it, and its "
        "lanes retry on the new one (actors/verify_deadline.py).",
    )
    verify_deadline_min_s: float = Field(
        default=30.0,
        gt=0,
        le=86_400,
        description="The least deadline of a verify forward (before any is measured, the first forwards' warm-up "
        "and compiles; a machine busy beside it).",
    )
    prefill_chunk_tokens: int | None = Field(
        default=256,
        ge=1,
        le=1_048_576,
        description="Most prompt (catch-up) tokens one verify forward carries, over all its sequences: a long "
        "prompt is prefilled over several rounds, interleaved with the other sequences' verification, and no "
        "forward holds attention over more new tokens than this. Smaller keeps other streams' gaps shorter "
        "during a long prefill (on a CPU a forward's cost grows with its tokens); None: no limit.",
    )
    prefill_round_factor: float | None = Field(
        default=None,
        ge=1.0,
        le=1_000,
        description="The inter-token budget of the streams decoding beside a long prompt's prefill, as a multiple "
        "of their round alone: a verify forward carrying a chunk of the prompt takes at most this many times the "
        "forward of its decoding rows' trees, by the forwards the replica measured (seconds by tokens), so it "
        "holds on any machine and context length; at least 8 prompt tokens a forward (the prompt always "
        "progresses), at most prefill_chunk_tokens, which a forward with no decoding row takes while the replica "
        "holds no other sequence. None: chunks of prefill_chunk_tokens (a GPU, where a forward of a few hundred "
        "tokens costs about one of a few).",
    )
    kv_budget_tokens: KvBudgetTokens = None
    kv_memory_fraction: KvMemoryFraction = 0.5
    shard_num_cpus: float = Field(default=1.0, ge=0, le=1024, description="CPUs each shard actor reserves.")
    cpu_cores: CpuCores = None
    borrow_cores: tuple[Annotated[int, Field(ge=0, le=65_535)], ...] = Field(
        default=(),
        description="CPU cores the target's GGUF kernel (weights: stored) also runs on during a verify that no "
        "draft call runs beside (a round the planner decodes plainly, a request without speculation): on a "
        "small machine, the draft's core, so plain decoding gets every core while speculation keeps the draft's. "
        "Its threads split a weight's outputs, so the tokens are the same; needs cpu_cores and tp_size 1.",
    )
    shard_num_gpus: float = Field(
        default=0.0, ge=0, le=1, description="GPUs each shard actor reserves (1 on GPU machines)."
    )
    deterministic: Deterministic = Field(
        default="auto",
        description="on: batch-invariant target forwards (speculative/engine/invariant.py): a row's logits are the "
        "same bits alone, in a verify, in a tree or beside other sequences, so speculation and batching never "
        "change greedy output in bfloat16 either; the start fails where this machine's kernels cannot give that. "
        "auto: on for a bfloat16 CPU target with tp_size 1 where the kernels allow it (a warning where not), else "
        "off (float32 targets keep the libraries' kernels: the float32 exactness tests hold on them). "
        "off: the kernels as the libraries pick them per shape.",
    )


class TargetConfig(TargetSettings):
    """One target replica: `tp_size` shard actors holding one tensor-parallel copy of the target."""

    model: ModelConfig = Field(description="The target model.")
    tp_size: int = Field(
        default=1, ge=1, le=64, description="Tensor-parallel degree: shard actors (and GPUs) per replica."
    )
    shard_start_timeout_s: float = Field(
        default=900.0, gt=0, le=7_200, description="Loading plus the first DeepSpeed compile may take minutes."
    )
    model_name: MetricsModelName = ""
    heads: DrafterConfig | None = Field(
        default=None,
        description="The drafter whose heads run beside the target (a kind that `runs_on` the target: medusa, "
        "eagle): read at each verdict, the tree of their guesses sent back with it; replicated on every "
        "tensor-parallel shard, which all hold the full hidden state, the embedding and the LM head.",
    )

    @model_validator(mode="after")
    def _target_exact(self) -> TargetConfig:
        if self.model.quantize != "none":
            raise ValueError("model.quantize: the target is never quantized (its tokens are the output)")
        if self.model.cpu_linear == "onednn" and self.tp_size > 1:
            raise ValueError("cpu_linear: 'onednn' needs tp_size 1 (tensor parallelism shards torch's Linear layers)")
        if self.cpu_cores is not None and len(self.cpu_cores) % self.tp_size:
            raise ValueError(
                f"cpu_cores: {len(self.cpu_cores)} cores do not split evenly over tp_size {self.tp_size} ranks"
            )
        if self.borrow_cores and (self.cpu_cores is None or self.tp_size > 1):
            raise ValueError("borrow_cores needs cpu_cores (the target's own cores) and tp_size 1")
        if set(self.borrow_cores) & set(self.cpu_cores or ()):
            raise ValueError(f"borrow_cores {list(self.borrow_cores)} overlap cpu_cores {list(self.cpu_cores or ())}")
        if self.deterministic == "on" and (self.tp_size > 1 or self.model.device != "cpu"):
            raise ValueError("deterministic: 'on' is for a CPU target with tp_size 1 (the invariant kernels' home)")
        if self.model.weights == "stored" and self.tp_size > 1:
            raise ValueError("weights: 'stored' needs tp_size 1 (tensor-parallel shards split dense weights)")
        if self.model.graphs == "on" and self.tp_size > 1:
            raise ValueError("graphs: 'on' needs tp_size 1 (tensor-parallel shards run their forwards op by op)")
        if self.deterministic == "on" and self.model.graphs == "on":
            raise ValueError("deterministic: 'on' runs the invariant kernels op by op; set model graphs: 'off'")
        if self.heads is not None and not self.heads.on_target:
            raise ValueError(f"heads: drafter kind {self.heads.kind!r} does not draft on the target")
        return self


class RouterConfig(BaseModel):
    """The ingress: sequences, lanes, and the step loop."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pipelining: bool = Field(
        default=True, description="Micro-batch ping-pong: draft one half of a lane while the target verifies the other."
    )
    round_ahead: bool = Field(
        default=True,
        description="While the target verifies a round, the draft pool drafts the next one from the continuation "
        "it expects (speculative/planning/ahead.py); a verdict that matches starts the next verify at once. Applies "
        "while "
        "a lane has one micro-batch group in flight (with two, ping-pong already keeps both pools busy).",
    )
    ahead_alternatives: int = Field(
        default=1,
        ge=0,
        le=8,
        description="Besides the guess of the bonus at the end of the path it assumes accepted, a pre-draft drafts "
        "this many branches where that path is likeliest cut (the draft's best other token there, by its own "
        "confidence), so a verdict that rejects a draft token can still find its next round drafted. Each "
        "widens the pre-draft's forwards by one token (near free while a forward reads weights, not computes).",
    )
    catch_up_beside_prefill: bool = Field(
        default=True,
        description="Round ahead: the draft model catches up on the prompt of a sequence alone in its lane beside "
        "the target's prefill, so the round after the first token drafts at once. Where the pools and the router "
        "share a few CPU cores (deploy/local.yaml), the catch-up slows the first token instead; off, the second "
        "round verifies no draft while the draft model catches up and pre-drafts the third beside it.",
    )
    ahead_prefill_tokens: int = Field(
        default=512,
        ge=0,
        le=1_000_000,
        description="A prompt with more tokens than this for the draft model to catch up on is not caught up on "
        "beside a verify (round ahead): the call would hold the draft replica, and the drafts of every other "
        "sequence it serves, for many rounds. The depth controller then decides when that sequence drafts, "
        "pricing its catch-up.",
    )
    max_lane_sequences: int = Field(
        default=16,
        ge=1,
        le=4096,
        description="Sequences per lane before a new lane opens. A lane is pinned to one draft and one target "
        "replica, so lanes are the unit that spreads load over replicas.",
    )
    max_lanes: int = Field(default=8, ge=1, le=1024, description="Lanes per router replica.")
    max_active_sequences: int = Field(
        default=256, ge=1, le=100_000, description="Admitted sequences per router replica; more are refused (overload)."
    )
    verify_retries: int = Field(
        default=12,
        ge=0,
        le=100,
        description="A failed verify call (replica lost) is retried, backing off 0.5 s doubling to 5 s (12: ~48 s, "
        "long enough for Serve to replace a lost replica); the retry re-prefills.",
    )
    draft_backoff_s: float = Field(
        default=2.0,
        ge=0,
        le=600,
        description="After a failed draft call the lane decodes without speculation this long.",
    )
    drafts_sampled: bool = Field(
        default=True,
        description="The draft pool samples drafts under sampling (rejection rule), so depth changes a seeded "
        "request's tokens: the load cap then spares sampled requests (set from the drafter config).",
    )
    lookup_ngrams: tuple[int, int] | None = Field(
        default=None,
        description="(max, min) suffix n-gram of prompt lookup (set from the drafter config): the router drafts "
        "by lookup itself (it costs nothing), depths following each sequence's current match.",
    )
    drafts_on_target: bool = Field(
        default=False,
        description="A drafter kind whose heads run on the target (set from the drafter config's `on_target`): "
        "the lane drafts the trees the target's heads drafted with each verdict, cut to each round's depth, at "
        "no draft cost.",
    )
    lookup_quotes: bool = Field(
        default=False,
        description="With lookup_ngrams beside a draft model (set from the drafter config): the router drafts by "
        "lookup only sequences quoting their context (greedy or deterministic drafts), free; the draft pool "
        "drafts the rest.",
    )
    draft_timeout_s: float = Field(
        default=5.0,
        gt=0,
        le=600,
        description="The fixed part of a draft call's deadline: a call past its deadline counts as failed (the "
        "lane decodes on without drafts for draft_backoff_s). While a lost draft replica is replaced, Serve holds "
        "calls until one is up, and the deadline keeps the lane from waiting on them.",
    )
    draft_timeout_per_token_s: float = Field(
        default=0.1,
        ge=0,
        le=60,
        description="The deadline's part per token of work the call carries (tokens to catch up on plus tokens "
        "to draft), so a new prompt's honest catch-up is never taken for a lost replica: 0.1 s a token allows "
        "10 tokens/s, several times slower than a draft model prefills even on one CPU core.",
    )
    max_stream_s: float = Field(
        default=600.0,
        ge=1,
        le=86_400,
        description="The longest a request may run, from admission to its last token: one still running then "
        "ends with an error (an SSE error event with code stream_timeout, gRPC DEADLINE_EXCEEDED). Serve drains a "
        "router replica it scales down or restarts for this plus a margin (the router deployment's "
        "graceful_shutdown_timeout_s), so every stream of that replica reaches its end or this error before the "
        "replica is stopped. 600 s: 32k tokens (a Qwen2.5 context window) at 55 tokens/s.",
    )
    stats_window: int = Field(default=4096, ge=1, le=1_000_000, description="Step records kept for stats().")
    model_name: MetricsModelName = ""
    depth: DepthConfig = Field(default_factory=DepthConfig, description="The depth controller's knobs.")


def deterministic_on(config: TargetConfig) -> bool:
    """Whether the target's forwards are made batch invariant (`deterministic`; auto: a CPU target of
    tp_size 1 in bfloat16, where the libraries' kernels change a row's rounding by the forward's shape, or on
    stored weights, whose kernel is invariant by construction: its attention is then made invariant too)."""
    if config.deterministic == "auto":
        model = config.model
        op_by_op = model.graphs != "on"
        bf16 = resolve_dtype(model.dtype, model.device) == "bfloat16"
        return model.device == "cpu" and config.tp_size == 1 and (bf16 or model.weights != "dequantized") and op_by_op
    return config.deterministic == "on"
