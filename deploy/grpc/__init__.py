"""The gRPC front door: `specserve.v1.SpecServe` (proto/specserve.proto) and `grpc.health.v1.Health` as the ingress's
methods, a request planned by the OpenAI HTTP API's own code (one validation for both doors), and its responses.

May import: `deploy.front`, `deploy.openai`, `actors`, `speculative.rules`, `proto`.
"""
