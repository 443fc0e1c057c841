"""What the front doors share (their config, the tokenizer, request errors, detokenizing, prompt text
to ids), the gRPC services' registration on Serve's proxy (`grpc_decoding`), and the proxy middleware that ends a
cut-off event stream. The gRPC front door's methods are `deploy.grpc`'s.

May import: `actors` (the router's types), `speculative.rules`, `proto`; not `deploy.openai`.
"""
