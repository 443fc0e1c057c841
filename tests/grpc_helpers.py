"""The gRPC front door's methods on a plain grpc.aio server, for tests (no Serve, no Ray).

`PlainServicer` hosts `GrpcIngress`'s methods (specserve.v1.SpecServe and grpc.health.v1's Check) and applies
their status the way Serve's gRPC proxy does; `run_grpc` serves one on a free local port for one scenario.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from deploy.front.grpc_decoding import add_servicer
from deploy.grpc.ingress import GrpcIngress, GrpcStatus
from proto import specserve_pb2 as pb
from proto import specserve_pb2_grpc as pb_grpc


class RecordedStatus:
    """A context for the methods on a plain grpc.aio server: records the status, applied at the end."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.trailing: list[tuple[str, str]] = []

    def invocation_metadata(self) -> Sequence[tuple[str, Any]]:
        return [(m[0], m[1]) for m in self._context.invocation_metadata() or ()]

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def set_trailing_metadata(self, trailing_metadata: list[tuple[str, str]]) -> None:
        self.trailing = trailing_metadata

    async def finish(self) -> None:
        if self.code is not None and self.code != grpc.StatusCode.OK:
            if self.trailing:
                self._context.set_trailing_metadata(tuple(self.trailing))
            await self._context.abort(self.code, self.details)


class PlainServicer(pb_grpc.SpecServeServicer):
    """`GrpcIngress` methods on a plain grpc.aio server: `add_servicer(PlainServicer(x), server)` (SpecServe and the
    health Check, as Serve's proxy registers them)."""

    def __init__(self, ingress: GrpcIngress) -> None:
        self._ingress = ingress

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        status = RecordedStatus(context)
        response = await self._ingress.Generate(request, grpc_context=status)
        await status.finish()
        return response

    async def GenerateStream(  # type: ignore[override]
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        status = RecordedStatus(context)
        try:
            async for message in self._ingress.GenerateStream(request, grpc_context=status):
                yield message
        except GrpcStatus:
            pass  # recorded on `status`
        await status.finish()

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext) -> pb.HealthResponse:
        return await self._ingress.Health(request, grpc_context=RecordedStatus(context))

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        status = RecordedStatus(context)
        response = await self._ingress.Check(request, grpc_context=status)
        await status.finish()
        return response


def run_grpc(
    ingress: GrpcIngress,
    scenario: Callable[[Any], Awaitable[Any]],
    options: Sequence[tuple[str, Any]] = (),
    raw: bool = False,
) -> Any:
    """Serve `ingress` on 127.0.0.1 (a free port) for one scenario, in this test's event loop; the scenario gets a
    `SpecServeStub`, or with `raw` the channel itself; `options`: the server's and the channel's gRPC options."""

    async def main() -> Any:
        server = grpc.aio.server(options=options)
        add_servicer(PlainServicer(ingress), server)  # as Serve's proxy registers it (grpc_servicer_functions)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
                return await scenario(channel if raw else pb_grpc.SpecServeStub(channel))
        finally:
            await server.stop(grace=None)

    return asyncio.run(main())
