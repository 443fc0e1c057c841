"""The application's one config: models, dtype, tensor parallelism, drafter, speculation limits,
and each pool's resources and autoscaling. `build_app` reads nothing else.

The same file runs on a laptop (`device: cpu`, fractional CPUs, no GPUs) and on a GPU cluster
(`num_gpus: 1` per draft replica and per target shard); `deploy/*.yaml` hold both.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, model_validator

from actors.config import (
    CPU_QUANTIZE,
    DraftWorkerConfig,
    DraftWorkerSettings,
    ModelConfig,
    ModelSettings,
    Quantize,
    RouterConfig,
    TargetConfig,
    TargetSettings,
    Weights,
)
from actors.scaling import BusyFractionPolicy
from deploy.front.frontdoor import FrontDoorConfig
from speculative.drafters.config import DrafterConfig, ModelDrafterConfig
from speculative.planning.depth import DepthConfig

_STRICT = ConfigDict(extra="forbid", frozen=True)

# A draining router replica's time beyond its longest stream: Serve polls the drain every
# graceful_shutdown_wait_loop_s (2 s), and the last error events still have to reach the proxy.
DRAIN_MARGIN_S = 10.0


def _custom_only(resources: dict[str, float]) -> dict[str, float]:
    taken = sorted({"CPU", "GPU", "memory", "object_store_memory"} & set(resources))
    if taken:
        raise ValueError(f"resources: {taken} are set by num_cpus / num_gpus, not as custom resources")
    return resources


# Custom resources a node declares (`ray start --resources`, KubeRay `rayStartParams.resources`).
NodeResources = Annotated[
    dict[Annotated[str, StringConstraints(min_length=1, max_length=128)], Annotated[float, Field(gt=0, le=1e6)]],
    AfterValidator(_custom_only),
]
AcceleratorType = Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]

# The resource Ray gives a node for its detected accelerator (ray._common.utils), and the share of it
# a request of `accelerator_type` takes (as Ray's own `accelerator_type` option does).
ACCELERATOR_PREFIX = "accelerator_type:"
ACCELERATOR_SHARE = 0.001


class Autoscaling(BaseModel):
    """One pool's replica count: fixed (min == max) or scaled by Serve on the pool's own signal."""

    model_config = _STRICT

    min_replicas: int = Field(default=1, ge=0, le=10_000, description="Fewest replicas (0 allows scale to zero).")
    max_replicas: int = Field(
        default=1, ge=1, le=10_000, description="Most replicas; equal to min_replicas: fixed size."
    )
    initial_replicas: int | None = Field(default=None, ge=0, le=10_000, description="Replicas at deploy time.")
    signal: Literal["busy", "queue"] = Field(
        default="busy",
        description="busy: share of wall time replicas compute (actors/scaling.py; right for draft and target "
        "pools, whose calls carry whole micro-batches); queue: Serve's ongoing requests per replica (right for "
        "the router, whose requests are client streams).",
    )
    target_busy: float = Field(default=0.6, gt=0, le=1, description="busy: desired busy fraction per replica.")
    target_ongoing_requests: float = Field(
        default=64.0, gt=0, le=1e6, description="queue: desired requests per replica."
    )
    upscale_delay_s: float = Field(
        default=10.0, ge=0, le=3600, description="Signal above target this long before adding."
    )
    downscale_delay_s: float = Field(
        default=120.0, ge=0, le=86_400, description="Signal below target this long before removing."
    )
    metrics_interval_s: float = Field(default=2.0, gt=0, le=600, description="How often replicas report.")
    look_back_period_s: float = Field(default=10.0, gt=0, le=3600, description="Window the signal is averaged over.")

    @model_validator(mode="after")
    def _bounds(self) -> Autoscaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas: must be <= max_replicas")
        return self

    @property
    def fixed(self) -> bool:
        return self.min_replicas == self.max_replicas

    def serve_options(self) -> dict[str, Any]:
        """`num_replicas` or `autoscaling_config`, as `serve.deployment(...).options` takes them."""
        if self.fixed:
            return {"num_replicas": self.min_replicas}
        config: dict[str, Any] = self.model_dump(
            include={
                "min_replicas",
                "max_replicas",
                "initial_replicas",
                "upscale_delay_s",
                "downscale_delay_s",
                "metrics_interval_s",
                "look_back_period_s",
            },
            exclude_none=True,
        )
        if self.signal == "busy":
            name = f"{BusyFractionPolicy.__module__}:{BusyFractionPolicy.__name__}"
            config["policy"] = {"policy_function": name, "policy_kwargs": {"target_busy": self.target_busy}}
        else:
            config["target_ongoing_requests"] = self.target_ongoing_requests
        return {"autoscaling_config": config}


def _fields(config: BaseModel, part: type[BaseModel]) -> dict[str, Any]:
    """`config`'s values of the fields it shares with `part` (a role's settings that a pool sets for it)."""
    return {name: getattr(config, name) for name in part.model_fields}


class DraftPoolConfig(DraftWorkerSettings):
    """Draft replicas: one draft model each, on its own GPU (or a share of the CPUs)."""

    model_config = _STRICT

    num_cpus: float = Field(default=1.0, ge=0, le=1024, description="CPUs per draft replica.")
    num_gpus: float = Field(default=0.0, ge=0, le=1, description="GPUs per draft replica (1 on GPU machines).")
    resources: NodeResources = Field(
        default_factory=dict,
        description="Custom resources per draft replica: only nodes declaring them take draft replicas "
        "(e.g. {draft_node: 0.01} with `ray start --resources '{\"draft_node\": 1}'` on draft nodes).",
    )
    accelerator_type: AcceleratorType | None = Field(
        default=None, description="Only nodes with this accelerator (Ray's name, e.g. L4, A10G) take draft replicas."
    )
    max_ongoing_requests: int = Field(default=64, ge=1, le=100_000, description="Concurrent lane calls per replica.")
    autoscaling: Autoscaling = Field(default_factory=Autoscaling, description="Replica count.")

    def actor_options(self) -> dict[str, Any]:
        """A draft replica's `ray_actor_options`; custom resources and accelerator type pin it to draft nodes."""
        options: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.resources:
            options["resources"] = dict(self.resources)
        if self.accelerator_type is not None:
            options["accelerator_type"] = self.accelerator_type
        return options


class TargetPoolConfig(TargetSettings):
    """Target replicas: `tp_size` shard actors each, in one STRICT_PACK placement group."""

    model_config = _STRICT

    resources: NodeResources = Field(
        default_factory=dict,
        description="Custom resources per shard (per placement bundle): only nodes declaring them take "
        "target shards (e.g. {target_node: 0.01} with `ray start --resources '{\"target_node\": 1}'`).",
    )
    accelerator_type: AcceleratorType | None = Field(
        default=None, description="Only nodes with this accelerator (Ray's name, e.g. A100, H100) take shards."
    )
    replica_num_cpus: float = Field(
        default=0.1, ge=0, le=64, description="CPUs of the replica actor itself (it only relays)."
    )
    max_ongoing_requests: int = Field(default=64, ge=1, le=100_000, description="Concurrent lane calls per replica.")
    health_check_period_s: float = Field(
        default=2.0,
        gt=0,
        le=600,
        description="How often Serve asks a target replica whether its shards live; a replica that lost one "
        "is replaced after the next check (Serve's default, 10 s, would stall its lanes that long).",
    )
    autoscaling: Autoscaling = Field(default_factory=Autoscaling, description="Replica count (TP groups).")

    def bundles(self, tp_size: int) -> list[dict[str, float]]:
        """A replica's `placement_group_bundles`: one per shard; the replica actor (no GPU) rides in
        bundle 0, as Serve requires.

        Every bundle carries the pool's custom resources (and accelerator type), so STRICT_PACK puts the
        whole group on one target node; the shards then take only CPU/GPU inside their bundle.
        """
        bundles = []
        for rank in range(tp_size):
            bundle = {"CPU": self.shard_num_cpus + (self.replica_num_cpus if rank == 0 else 0.0)}
            if self.shard_num_gpus:
                bundle["GPU"] = self.shard_num_gpus
            bundle.update(self.resources)
            if self.accelerator_type is not None:
                bundle[ACCELERATOR_PREFIX + self.accelerator_type] = ACCELERATOR_SHARE
            bundles.append(bundle)
        return bundles


class RouterPoolConfig(BaseModel):
    """Router replicas: the ingress; each holds its own sequences and lanes."""

    model_config = _STRICT

    num_cpus: float = Field(default=0.5, ge=0, le=64, description="CPUs per router replica.")
    max_ongoing_requests: int = Field(
        default=1024, ge=1, le=1_000_000, description="Open requests (streams) per replica."
    )
    router: RouterConfig = Field(default_factory=RouterConfig, description="Lanes, pipelining, retries.")
    autoscaling: Autoscaling = Field(default_factory=lambda: Autoscaling(signal="queue"), description="Replica count.")

    @property
    def graceful_shutdown_timeout_s(self) -> float:
        """How long Serve drains a router replica before it stops it: the longest a stream may run
        (`router.max_stream_s`, after which it ends with an error event) plus `DRAIN_MARGIN_S`."""
        return self.router.max_stream_s + DRAIN_MARGIN_S


class AppConfig(ModelSettings):
    """Everything `deploy.app.build_app` needs; the `args:` of a Serve YAML."""

    model_config = _STRICT

    target_model: str = Field(min_length=1, description="Registry short name (modelstore/), HF folder or hub id.")
    draft_model: str | None = Field(default=None, description="The draft model; None for drafters without one.")
    draft_quantize: Quantize = Field(
        default="none",
        description="int8: the draft model's Linear weights in int8 (CPU only; the rest of it in float32), "
        "about 2x faster per draft step than bfloat16 on a CPU; int4: 4-bit weight groups (CPU only): for draft "
        "steps, bfloat16 for catch-up, where bfloat16 is native; elsewhere float32 activations on the AVX2 GGUF "
        "kernel for every forward; auto: int4 on CPUs with native bfloat16 or the AVX2 kernel, int8 on other "
        "CPUs, none on a GPU. The target is never re-quantized (`target_weights`).",
    )
    target_weights: Weights = Field(
        default="dequantized",
        description="auto: the target's Linear layers at the precision its GGUF file stores them (Q4_K, Q6_K, "
        "Q8_0 through our AVX-512 VNNI or AVX2 kernel; registry models keep their GGUF), where the CPU runs a "
        "kernel and tp_size is 1, else dequantized; stored: that or an error saying why not; dequantized: the weights "
        "expanded to `dtype` (the Hugging Face model itself: what exactness tests against transformers use).",
    )
    tp_size: int = Field(default=1, ge=1, le=64, description="Tensor-parallel degree of each target replica.")
    model_cache_dir: str | None = Field(
        default=None, description="Where registry models are fetched ($SPECSERVE_MODELS)."
    )
    drafter: DrafterConfig = Field(
        default_factory=ModelDrafterConfig,
        description="The drafter kind and its own fields (`kind`: none, model, lookup, hybrid, medusa, eagle); "
        "the app deploys what the kind needs: a draft pool for model and hybrid, heads on the target replica "
        "for medusa and eagle, nothing for lookup (the router drafts it) and none.",
    )
    speculation: DepthConfig = Field(
        default_factory=DepthConfig, description="How deep sequences draft: the depth controller's knobs."
    )
    draft_pool: DraftPoolConfig = Field(default_factory=DraftPoolConfig, description="Draft replicas (a draft model).")
    target_pool: TargetPoolConfig = Field(default_factory=TargetPoolConfig, description="Target replicas.")
    router_pool: RouterPoolConfig = Field(default_factory=RouterPoolConfig, description="Router replicas.")
    front_door: FrontDoorConfig | None = Field(
        default=None,
        description="OpenAI HTTP + gRPC front doors on the router (needs the target's tokenizer); "
        "None serves token ids through the deployment handle only.",
    )

    @model_validator(mode="after")
    def _draft_model_when_needed(self) -> AppConfig:
        if self.drafter.needs_draft_model and self.draft_model is None:
            raise ValueError(f"draft_model: drafter kind {self.drafter.kind!r} needs a draft model")
        if self.draft_quantize in CPU_QUANTIZE and self.device != "cpu":
            raise ValueError(
                f"draft_quantize: {self.draft_quantize!r} runs on CPU only (torch's CPU kernels); use device: cpu"
            )
        if self.cpu_linear == "onednn" and self.tp_size > 1:
            raise ValueError("cpu_linear: 'onednn' is for tp_size 1 (tensor parallelism shards torch's Linear layers)")
        return self

    @property
    def served_model_name(self) -> str:
        """The model's name to clients and on the metrics: the front door's `served_model_name`, else the target."""
        return self.front_door.served_model_name if self.front_door is not None else self.target_model

    def _model(self, path: str, quantize: Quantize = "none", weights: Weights = "dequantized") -> ModelConfig:
        return ModelConfig(path=path, quantize=quantize, weights=weights, **_fields(self, ModelSettings))

    def draft_worker(self) -> DraftWorkerConfig | None:
        """None unless the drafter kind drafts with a draft model (model, hybrid): no draft pool is deployed,
        so none holds a replica (or a GPU) that no call would reach."""
        if not self.drafter.needs_draft_model or self.draft_model is None:
            return None
        return DraftWorkerConfig(
            model=self._model(self.draft_model, self.draft_quantize),
            target_model=self.target_model,
            model_name=self.served_model_name,
            drafter=self.drafter,
            **_fields(self.draft_pool, DraftWorkerSettings),
        )

    def target(self) -> TargetConfig:
        return TargetConfig(
            model=self._model(self.target_model, weights=self.target_weights),
            tp_size=self.tp_size,
            heads=self.drafter if self.drafter.on_target else None,
            model_name=self.served_model_name,
            **_fields(self.target_pool, TargetSettings),
        )

    def router(self) -> RouterConfig:
        drafter = self.drafter
        update = {
            "depth": self.speculation,
            "drafts_sampled": drafter.drafts_sampled,
            "lookup_ngrams": drafter.lookup_ngrams,
            "lookup_quotes": drafter.quotes_in_router,
            "drafts_on_target": drafter.on_target,
            "model_name": self.served_model_name,
        }
        return self.router_pool.router.model_copy(update=update)
