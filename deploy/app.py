"""The Serve application: router (ingress) -> draft pool + target pool, built from one `AppConfig`.

    serve run deploy/local.yaml             # or: serve run deploy.app:app_builder target_model=...
    # gRPC: the YAML's top-level grpc_options name deploy.front.grpc_decoding.GRPC_SERVICER_FUNCTIONS
    serve deploy deploy/cluster.yaml        # on a running cluster (KubeRay: the same import path)

Embedded (a laptop, a test): `serve.run(build_app(config))` after `ray.init()`.

Ray decorators are applied here, at build time; the classes in `actors/` are plain Python.
"""

from __future__ import annotations

import functools
from typing import Any

from ray import serve
from ray.serve import Application

from actors.affinity import LaneAffinityRouter
from actors.draft_worker import DraftWorker
from actors.router import Router
from actors.target_replica import TargetReplica
from deploy.config import AppConfig
from deploy.front import exposure
from deploy.ingress import Ingress
from modelstore import resolve

# Lane calls go to the lane's pinned replica (actors/affinity.py).
_AFFINITY = {"request_router_class": f"{LaneAffinityRouter.__module__}.{LaneAffinityRouter.__name__}"}

# Draft and target calls are the hot path (one per lane per round): no per-call access log.
_QUIET = {"enable_access_log": False}


def build_app(config: AppConfig) -> Application:
    if config.front_door is not None:  # (without one, the proxies serve no route of ours)
        exposure.check(config.front_door, exposure.running_serve())  # no open door by accident
    resolver = functools.partial(resolve, cache_dir=config.model_cache_dir)
    draft_cfg = config.draft_worker()
    draft = None
    if draft_cfg is not None:
        pool = config.draft_pool
        draft = serve.deployment(
            name="draft",
            ray_actor_options=pool.actor_options(),
            max_ongoing_requests=pool.max_ongoing_requests,
            request_router_config=_AFFINITY,
            logging_config=_QUIET,
            **pool.autoscaling.serve_options(),
        )(DraftWorker).bind(draft_cfg, resolver, own_process=True)
    target_pool = config.target_pool
    target = serve.deployment(
        name="target",
        ray_actor_options={"num_cpus": target_pool.replica_num_cpus, "num_gpus": 0},
        placement_group_bundles=target_pool.bundles(config.tp_size),
        placement_group_strategy="STRICT_PACK",
        max_ongoing_requests=target_pool.max_ongoing_requests,
        health_check_period_s=target_pool.health_check_period_s,
        request_router_config=_AFFINITY,
        logging_config=_QUIET,
        **target_pool.autoscaling.serve_options(),
    )(TargetReplica).bind(config.target(), resolver)
    router_pool = config.router_pool
    options: dict[str, Any] = {
        "name": "router",
        "ray_actor_options": {"num_cpus": router_pool.num_cpus},
        "max_ongoing_requests": router_pool.max_ongoing_requests,
        # It holds the streams: drained until each has ended (at the latest at max_stream_s, with an error).
        "graceful_shutdown_timeout_s": router_pool.graceful_shutdown_timeout_s,
        **router_pool.autoscaling.serve_options(),
    }
    kwargs = {"tokenizer": config.target_model, "resolve": resolver}
    if config.front_door is None:  # handle-only (token ids in, token ids out)
        return serve.deployment(**options)(Router).bind(config.router(), draft, target, **kwargs)
    ingress = serve.deployment(**options)(serve.ingress()(Ingress))
    return ingress.bind(config.front_door, config.router(), draft, target, **kwargs)


def app_builder(args: dict[str, Any]) -> Application:
    """Serve's application builder: `import_path: deploy.app:app_builder`, the YAML's `args` are an AppConfig."""
    return build_app(AppConfig.model_validate(args))
