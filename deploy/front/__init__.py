"""What the front doors share (their config, the tokenizer, request errors, detokenizing, prompt text
to ids), the gRPC front door, and the proxy middleware that ends a cut-off event stream.

May import: `actors` (the router's types), `speculative.rules`, `proto`; not `deploy.openai`.
"""
