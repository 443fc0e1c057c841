"""The OpenAI-compatible HTTP API: `/v1/completions`, `/v1/chat/completions`, `/v1/models`, vLLM's
`/tokenize`, structured output, log-prob formats, unknown fields, and the FastAPI ingress over the router.

May import: `deploy.front`, `actors`, `speculative.rules`.
"""
