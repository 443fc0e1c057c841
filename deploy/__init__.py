"""The Serve application: its one config (`config.py`) and builder (`app.py`), the ingress class, the
command line, the Kubernetes rendering, the dependency lock (`lock.py`), and the Serve YAMLs. Subpackages:
`front/` (what the front doors share, and gRPC), `openai/` (the OpenAI-compatible HTTP API), `local/` (the
embedded local run and the in-process decoder from model names).

May import: everything above it (`actors`, `speculative`, `modelstore`, `proto`).
"""
