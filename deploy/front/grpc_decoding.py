"""Registering `specserve.v1.SpecServe` and `grpc.health.v1.Health` on Serve's gRPC proxy, with request decoding
that never raises.

`add_servicer` is what `grpc_options.grpc_servicer_functions` names (GRPC_SERVICER_FUNCTIONS). Serve's proxy
routes every method it registers to the ingress method of the same name (`Generate`, `Check`, ...): the
standard health service is served by the ingress like SpecServe, through the same proxy and port, so a
`grpc_health_probe` or a Kubernetes `grpc:` probe asks the router replicas. Only `Check` is registered: `Watch`
(a stream held open for ever, which would hold a router replica's request slot and its drain) gets grpc's
UNIMPLEMENTED, as the health protocol allows. Server reflection is Serve's own (`grpc_options.enable_reflection`,
on by default), answered by the proxy from the descriptors these imports register.

grpc decodes a request's bytes with the method's `FromString` before any code of ours runs, and bytes that are
not that message end the call with UNKNOWN ("Exception deserializing request"): to a client, a server fault.
The handlers are registered with a decoder that hands such bytes on as `Undecodable`, which the ingress answers
with INVALID_ARGUMENT naming the message it expected. It imports only grpc and the stubs: Serve's proxies import
it, and stay light.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2

from proto import specserve_pb2_grpc as pb_grpc

SERVICER_FUNCTION = f"{__name__}.add_servicer"
GRPC_SERVICER_FUNCTIONS = [SERVICER_FUNCTION]  # grpc_options.grpc_servicer_functions
HEALTH_SERVICE = "grpc.health.v1.Health"


class Undecodable:
    """Request bytes that are not the method's message; `error`: the decoder's words."""

    def __init__(self, error: str) -> None:
        self.error = error  # (pickled as it is: Serve sends requests from its proxy to the replica)


def add_servicer(servicer: Any, server: Any) -> None:
    """`add_SpecServeServicer_to_server` and grpc.health.v1's `Check`, each method's requests decoded by `tolerant`."""
    tolerant_server = _TolerantServer(server)
    pb_grpc.add_SpecServeServicer_to_server(servicer, tolerant_server)
    check = grpc.unary_unary_rpc_method_handler(
        servicer.Check,
        request_deserializer=health_pb2.HealthCheckRequest.FromString,
        response_serializer=health_pb2.HealthCheckResponse.SerializeToString,
    )
    tolerant_server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(HEALTH_SERVICE, {"Check": check}),))


def tolerant(decode: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def decoded(data: bytes) -> Any:
        try:
            return decode(data)
        except DecodeError as e:
            return Undecodable(str(e) or "not a protobuf message")

    return decoded


def _tolerant_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    decode = handler.request_deserializer
    return handler if decode is None else handler._replace(request_deserializer=tolerant(decode))  # type: ignore[attr-defined]


class _TolerantServer:
    """The server the generated registration sees: its handlers' decoders swapped on the way in."""

    def __init__(self, server: Any) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers: Sequence[Any]) -> None:
        for handler in handlers:  # grpc's method_handlers_generic_handler keeps them here (Serve reads them too)
            handler._method_handlers = {k: _tolerant_handler(v) for k, v in handler._method_handlers.items()}
        self._server.add_generic_rpc_handlers(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        add = getattr(self._server, "add_registered_method_handlers", None)
        if add is not None:
            add(service, {k: _tolerant_handler(v) for k, v in handlers.items()})

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)
