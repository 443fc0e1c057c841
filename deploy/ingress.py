"""The ingress deployment's class: the router with its two front doors (OpenAI HTTP and gRPC).

Serve builds the FastAPI app on each replica after the constructor (`__serve_build_asgi_app__`),
so the HTTP routes and the gRPC methods call that replica's own `generate` / `generate_stream`,
with no handle in between.
"""

from __future__ import annotations

from typing import Any

from actors.config import RouterConfig
from actors.loading import Resolver, identity
from actors.router import Router
from deploy.frontdoor import FrontDoorConfig, load_front_door
from deploy.grpc_ingress import GrpcIngress
from deploy.http_ingress import OpenAIIngress


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
