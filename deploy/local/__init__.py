"""The local run: the server on an embedded Ray with the default models (`make run`), and an
in-process speculative decoder from model names (the CLI's `generate`, the benchmarks).

May import: `deploy` (the app and its config), `modelstore`, `actors`, `speculative`.
"""
