"""The ingress deployment's class: the router with its two front doors (OpenAI HTTP and gRPC).

Serve builds the FastAPI app on each replica after the constructor (`__serve_build_asgi_app__`),
so the HTTP routes and the gRPC methods call that replica's own `generate` / `generate_stream`,
with no handle in between.

Readiness (GET /health, gRPC Health) asks the target pool each time (`ready`), not the router's
target info, which is fetched once: a pool whose replica lost a shard reads as not ready until
Serve has replaced it.
"""

from __future__ import annotations

from typing import Any

from actors.config import RouterConfig
from actors.loading import Resolver, identity
from actors.router import Router
from deploy.front.frontdoor import FrontDoorConfig, load_front_door
from deploy.grpc.ingress import GrpcIngress
from deploy.openai.http_ingress import OpenAIIngress


class Ingress(OpenAIIngress, GrpcIngress, Router):
    def __init__(
        self,
        front: FrontDoorConfig,
        config: RouterConfig,
        draft: Any,
        target: Any,
        *,
        tokenizer: str,
        resolve: Resolver = identity,
    ) -> None:
        Router.__init__(self, config, draft, target, tokenizer=tokenizer, resolve=resolve)
        self.front = load_front_door(front, tokenizer, resolve)

    async def ready(self) -> None:
        """A target replica answers `ping` (every shard of it alive) now; raises otherwise."""
        await self._target.call("ping", None)  # the router's pool of target replicas (no lane: any replica)
