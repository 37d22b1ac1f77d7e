"""HTTP probes for hosts that cannot speak gRPC: /healthz, /readyz, /metrics.

No prompt or output ever reaches this port: only states, counts and sizes.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.rss = Gauge("mlxserve_runner_rss_bytes", "Runner process tree RSS", ["model"], registry=r)
        self.anonymous = Gauge(
            "mlxserve_runner_anonymous_bytes", "Runner RSS minus shared (mapped) memory", ["model"], registry=r
        )
        self.mlx_cache = Gauge("mlxserve_runner_mlx_cache_bytes", "MLX buffer pool size", ["model"], registry=r)
        self.mlx_active = Gauge("mlxserve_runner_mlx_active_bytes", "MLX active memory", ["model"], registry=r)
        self.releases = Gauge(
            "mlxserve_runner_pool_releases", "Pool releases by the current runner process", ["model"], registry=r
        )
        self.soft_releases = Gauge(
            "mlxserve_soft_limit_releases", "ReleaseMemory calls by the memory policy", ["model"], registry=r
        )
        self.prompt_cache_entries = Gauge(
            "mlxserve_prompt_cache_entries", "Entries in the runner's prompt cache", ["model"], registry=r
        )
        self.prompt_cache_bytes = Gauge(
            "mlxserve_prompt_cache_bytes", "Bytes the runner's prompt cache holds", ["model"], registry=r
        )
        self.prompt_cache_hits = Gauge(
            "mlxserve_prompt_cache_hits",
            "Requests that reused a cached prefix (current runner process)",
            ["model"],
            registry=r,
        )
        self.prompt_cache_reused = Gauge(
            "mlxserve_prompt_cache_reused_tokens",
            "Prompt tokens taken from the cache instead of prefilled (current runner process)",
            ["model"],
            registry=r,
        )
        self.prompt_cache_evictions = Gauge(
            "mlxserve_prompt_cache_evictions",
            "Prompt-cache entries evicted (current runner process)",
            ["model"],
            registry=r,
        )
        self.restarts = Gauge(
            "mlxserve_runner_restarts", "Runner restarts since the supervisor started", ["model"], registry=r
        )
        self.serving = Gauge("mlxserve_runner_serving", "1 while the model's runner serves", ["model"], registry=r)
        self.requests = Counter("mlxserve_requests", "Generate requests by final status", ["model", "code"], registry=r)
        self.tokens = Counter("mlxserve_generated_tokens", "Tokens generated", ["model"], registry=r)
        self.resumes = Counter(
            "mlxserve_resumed_answers", "Answers resumed on a restarted runner after theirs died", ["model"], registry=r
        )
        self.acceptance = Gauge(
            "mlxserve_acceptance_rate", "Draft acceptance of the last request", ["model"], registry=r
        )
        self.ttft = Histogram(
            "mlxserve_time_to_first_token_seconds",
            "Time to first token",
            ["model"],
            registry=r,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.drafted = Counter("mlxserve_drafted_tokens", "Tokens proposed by a drafter", ["model"], registry=r)
        self.accepted = Counter("mlxserve_accepted_tokens", "Drafted tokens the target accepted", ["model"], registry=r)
        self.draft_rounds = Counter(
            "mlxserve_draft_rounds",
            "Rounds that verified a draft (drafted / draft_rounds: mean depth)",
            ["model"],
            registry=r,
        )
        self.active_requests = Gauge(
            "mlxserve_active_requests", "Requests the runner is prefilling or decoding", ["model"], registry=r
        )
        self.pull_completed = Gauge(
            "mlxserve_pull_completed_bytes", "Bytes fetched so far by a pull in flight", ["model"], registry=r
        )
        self.pull_total = Gauge("mlxserve_pull_total_bytes", "Bytes a pull in flight fetches", ["model"], registry=r)
        self.queued_requests = Gauge(
            "mlxserve_queued_requests", "Requests waiting in the runner", ["model"], registry=r
        )
        self.soft_limit = Gauge(
            "mlxserve_runner_soft_limit_bytes", "The model's soft memory limit (0: none)", ["model"], registry=r
        )
        self.hard_limit = Gauge(
            "mlxserve_runner_hard_limit_bytes", "The model's hard memory limit (0: none)", ["model"], registry=r
        )
        # Embedding and reranking models (supervisor/embeddings.py).
        self.embed_requests = Counter(
            "mlxserve_embed_requests",
            "Embed and Rerank requests by kind (embed, rerank) and final status",
            ["model", "kind", "code"],
            registry=r,
        )
        self.embedded_inputs = Counter(
            "mlxserve_embedded_inputs", "Inputs embedded, or documents scored", ["model"], registry=r
        )
        self.embedded_tokens = Counter("mlxserve_embedded_tokens", "Tokens of those inputs", ["model"], registry=r)
        self.embed_seconds = Histogram(
            "mlxserve_embed_seconds",
            "Time of an Embed or Rerank request through its runner",
            ["model"],
            registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.generated: dict[str, int] = {}  # model -> tokens relayed since start, counted as they go (top's rates)
        self.embedded: dict[str, tuple[int, int, float]] = {}  # model -> (requests, inputs, seconds): top's
        self.last_acceptance: dict[str, float] = {}

    def embedded_request(self, model: str, inputs: int, tokens: int, seconds: float) -> None:
        """An Embed or Rerank request answered: its inputs, their tokens and its time, into the counters."""
        self.embedded_inputs.labels(model).inc(inputs)
        self.embedded_tokens.labels(model).inc(tokens)
        self.embed_seconds.labels(model).observe(seconds)
        requests, counted, total = self.embedded.get(model, (0, 0, 0.0))
        self.embedded[model] = (requests + 1, counted + inputs, total + seconds)

    def finished(self, model: str, stats) -> None:
        """A generation's final figures (its GenerationStats) into the counters."""
        self.tokens.labels(model).inc(stats.generated_tokens)
        if stats.drafted:
            self.acceptance.labels(model).set(stats.acceptance_rate)
            self.last_acceptance[model] = stats.acceptance_rate
            self.drafted.labels(model).inc(stats.drafted)
            self.accepted.labels(model).inc(stats.accepted)
            self.draft_rounds.labels(model).inc(sum(n for depth, n in stats.depths.items() if depth > 0))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ProbeServer:
    def __init__(self, port: int, metrics: Metrics, ready, host: str = "127.0.0.1"):
        metrics_, ready_ = metrics, ready

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path == "/healthz":
                    self._send(200, b"ok\n")
                elif self.path == "/readyz":
                    ok, detail = ready_()
                    self._send(200 if ok else 503, (detail + "\n").encode())
                elif self.path == "/metrics":
                    self._send(200, metrics_.render(), CONTENT_TYPE_LATEST)
                else:
                    self._send(404, b"not found\n")

            def _send(self, code, body, content_type="text/plain; charset=utf-8"):
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="probes", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
