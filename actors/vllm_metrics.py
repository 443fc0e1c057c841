"""vLLM's request metrics, under vLLM's names and semantics (`vllm/v1/metrics/loggers.py`), as Ray Serve LLM
exports them: vLLM's Ray metrics wrapper writes `vllm:X` as `vllm_X` (a colon is no Ray metric character) and
Ray's endpoint shows it as `ray_vllm_X` (a counter with `_total`), every one with the `model_name` label. So
Ray's own Serve LLM dashboard and vLLM queries read specserve as they read vLLM (docs/metrics.md maps each).

A request's moments, as vLLM names them (`Live` keeps them, all `time.time()`):
- arrival: the router took the request (`Live.admitted`);
- scheduled: its first verify call left (vLLM: it left the waiting queue; `Live.scheduled`);
- first token: its first tokens were sent (`Live.first_token`); last token: its last (`Live.last_emit`).
queue time = scheduled - arrival, prefill time = first token - scheduled, decode time = last token - first
token, end to end = end - arrival; time per output token = decode time / (generated tokens - 1).
Waiting and running: admitted requests before and after their first verify (those asking a target replica for
their KV reservation wait too).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from actors.metrics import Recorders
    from actors.records import Live

# vLLM's histogram boundaries (loggers.py), so quantiles read alike.
TTFT_BUCKETS = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
]  # fmt: skip
TOKEN_LATENCY_BUCKETS = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
]  # fmt: skip
REQUEST_LATENCY_BUCKETS = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
]  # fmt: skip
# vLLM's 1-2-5 series up to the model's window (here up to a million tokens, the window not known yet)
TOKEN_COUNT_BUCKETS = [float(m * 10**e) for e in range(7) for m in (1, 2, 5) if m * 10**e <= 1_000_000]

# specserve's finish reason -> vLLM's `finished_reason` (a client gone is vLLM's abort)
FINISHED_REASON = {"stop": "stop", "length": "length", "cancelled": "abort", "error": "error"}


class VllmMetrics:
    """vLLM's request families, recorded by the router."""

    def __init__(self, r: Recorders) -> None:
        self.running = r.gauge("vllm_num_requests_running", "Requests in model execution batches.")
        self.waiting = r.gauge("vllm_num_requests_waiting", "Requests waiting to be processed.")
        self.prompt_tokens = r.counter("vllm_prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = r.counter("vllm_generation_tokens", "Number of generation tokens processed.")
        self.success = r.counter("vllm_request_success", "Count of finished requests.", "finished_reason")
        self.prompt_length = r.histogram("vllm_request_prompt_tokens", "Prefill tokens.", TOKEN_COUNT_BUCKETS)
        self.generation_length = r.histogram(
            "vllm_request_generation_tokens", "Generation tokens.", TOKEN_COUNT_BUCKETS
        )
        self.ttft = r.histogram("vllm_time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = r.histogram(
            "vllm_inter_token_latency_seconds", "Time between a request's steps.", TOKEN_LATENCY_BUCKETS
        )
        self.tpot = r.histogram(
            "vllm_request_time_per_output_token_seconds", "Decode time per output token.", TOKEN_LATENCY_BUCKETS
        )
        self.e2e = r.histogram("vllm_e2e_request_latency_seconds", "End-to-end latency.", REQUEST_LATENCY_BUCKETS)
        self.queue = r.histogram("vllm_request_queue_time_seconds", "Time waiting.", REQUEST_LATENCY_BUCKETS)
        self.prefill = r.histogram("vllm_request_prefill_time_seconds", "Time in prefill.", REQUEST_LATENCY_BUCKETS)
        self.decode = r.histogram("vllm_request_decode_time_seconds", "Time in decode.", REQUEST_LATENCY_BUCKETS)

    def census(self, running: int, waiting: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)

    def emitted(self, live: Live, new_tokens: int, now: float) -> None:
        """A step sent `new_tokens` (> 0) of the request: its prompt counts as processed with its first tokens,
        and vLLM's inter-token latency is per step (a draft round's tokens come together)."""
        if live.last_emit is None:
            self.prompt_tokens.inc(len(live.seq.prompt))
            self.ttft.observe(now - live.admitted)
        else:
            self.itl.observe(now - live.last_emit)
        self.generation_tokens.inc(new_tokens)

    def finished(self, live: Live, reason: str, now: float) -> None:
        """The request ended with specserve's `reason` (stop, length, cancelled, error)."""
        seq = live.seq
        self.success.inc(1, tags={"finished_reason": FINISHED_REASON.get(reason, reason)})
        self.prompt_length.observe(len(seq.prompt))
        self.generation_length.observe(len(seq.output))
        self.e2e.observe(now - live.admitted)
        if live.scheduled is not None:
            self.queue.observe(live.scheduled - live.admitted)
        if live.scheduled is None or live.first_token is None or live.last_emit is None:
            return  # never prefilled: no prefill or decode time
        decode = live.last_emit - live.first_token
        self.prefill.observe(live.first_token - live.scheduled)
        self.decode.observe(decode)
        if len(seq.output) > 1:
            self.tpot.observe(decode / (len(seq.output) - 1))
