"""The public gRPC API (`specserve.proto`, package `specserve.v1`) and its generated stubs.

`make proto` generates `specserve_pb2.py`, `specserve_pb2.pyi` and `specserve_pb2_grpc.py` here
(git-ignored) with the repo root as the include path, so the stubs import each other as
`proto.specserve_pb2`:

    python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. proto/specserve.proto

This package shares its name with `proto-plus`'s top-level `proto` module (a dependency of
google-api-core). The repo root comes first on the path wherever specserve runs (Serve's
working_dir, `python -m` from the root, pytest), so `proto` is this package there; a process that
also needs proto-plus must not run from the repo root.
"""
