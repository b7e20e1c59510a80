"""Serving: the continuous-batching engine, its thread and queue, the OpenAI-compatible
HTTP server with a live GSM config, Prometheus metrics, and the HTTP load test.

- `engine`: `Engine` (prefill / insert / generate over fixed slots, chunked prefill,
  per-request GSM configs and sampling), `Request`, `RequestRecord`;
- `scheduler`: `EngineLoop`, the engine's thread behind a bounded admission queue;
- `gsm_state`: `LiveGSM`, the versioned config with rollout arms and rollback;
- `app`: the FastAPI app and `serve` (imports FastAPI: kept out of this package's
  import so the engine needs no web stack);
- `metrics`: the Prometheus metrics; `bench_client`: `gsm-jax bench-serve`.
"""

from gsm_jax.serving.engine import DEFAULT, Engine, Request, RequestRecord

__all__ = ["DEFAULT", "Engine", "Request", "RequestRecord"]
