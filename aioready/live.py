"""Live metrics for Prometheus: an instrument that keeps counters and an HTTP endpoint.

`PrometheusInstrument` implements the instrument hooks (aioready/instruments.py) and updates,
per rank: tasks run, messages and bytes sent, activations in flight (live, per task), busy
fraction, and per step: step time, bubble fraction, efficiency. `serve_metrics(port)` exposes its
registry over HTTP in a daemon thread (prometheus_client's own server), so scraping never touches
the event loop. Under mpirun each rank serves on port + rank. Needs the `telemetry` extra.
"""

from __future__ import annotations

from typing import Any

from .devices.base import TaskInfo
from .errors import ConfigError
from .tasks import Kind
from .telemetry import StepMetrics, StepReport
from .transports.base import Message

__all__ = ["PrometheusInstrument", "serve_metrics", "METRIC_NAMES"]

METRIC_NAMES = (
    "aioready_busy_fraction", "aioready_step_time_seconds", "aioready_tasks_total",
    "aioready_messages_sent_total", "aioready_bytes_sent_total",
    "aioready_activations_in_flight", "aioready_steps_total", "aioready_efficiency",
    "aioready_bubble_fraction",
)


def _client() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise ConfigError("live metrics need prometheus_client", expected="the package "
                          "installed", got="not importable",
                          fix="pip install 'aioready[telemetry]'") from None
    return prometheus_client


class PrometheusInstrument:
    """Counters and gauges of a run, in their own CollectorRegistry (no global state)."""

    def __init__(self, registry: Any = None, *, split_backward: bool = False) -> None:
        pc = _client()
        self.registry = registry if registry is not None else pc.CollectorRegistry()
        r = self.registry
        self.busy = pc.Gauge("aioready_busy_fraction", "share of the last step a rank's device "
                             "was busy", ["rank"], registry=r)
        self.step_time = pc.Gauge("aioready_step_time_seconds", "time of the last step",
                                  registry=r)
        self.tasks = pc.Counter("aioready_tasks", "tasks run", ["rank", "kind"], registry=r)
        self.messages = pc.Counter("aioready_messages_sent", "messages sent", ["rank"],
                                   registry=r)
        self.bytes = pc.Counter("aioready_bytes_sent", "payload bytes sent", ["rank"],
                                registry=r)
        self.in_flight = pc.Gauge("aioready_activations_in_flight", "microbatches holding "
                                  "activations on a rank now", ["rank"], registry=r)
        self.steps = pc.Counter("aioready_steps", "steps finished", registry=r)
        self.efficiency = pc.Gauge("aioready_efficiency", "lower bound / step time of the last "
                                   "step", registry=r)
        self.bubble = pc.Gauge("aioready_bubble_fraction", "idle share of the last step",
                               registry=r)
        self._last_kind = Kind.W if split_backward else Kind.B  # frees the in-flight slot
        self._children: dict[tuple[Any, ...], Any] = {}

    def _child(self, metric: Any, *labels: Any) -> Any:
        """metric.labels(...) is ~10x the cost of an inc(): look each child up once."""
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*(str(v) for v in labels))
        return child

    def before_task(self, info: TaskInfo) -> None:
        if info.kind is Kind.F and info.chunk == 0:
            self._child(self.in_flight, info.rank).inc()

    def after_task(self, info: TaskInfo, start: float, end: float) -> None:
        self._child(self.tasks, info.rank, info.kind.name).inc()
        if info.chunk == 0 and info.kind is self._last_kind:
            self._child(self.in_flight, info.rank).dec()

    def message_sent(self, rank: int, dest: int, msg: Message, nbytes: int) -> None:
        self._child(self.messages, rank).inc()
        self._child(self.bytes, rank).inc(nbytes)

    def after_step(self, report: StepReport, metrics: StepMetrics) -> None:
        ranks = {s.rank for s in report.spans}
        for rank in ranks:
            self.busy.labels(str(rank)).set(metrics.busy_fraction[rank])
        self.step_time.set(metrics.step_time)
        self.efficiency.set(metrics.efficiency)
        self.bubble.set(metrics.bubble_fraction)
        self.steps.inc()

    def exposition(self) -> bytes:
        """The metrics in Prometheus text format (for services that serve /metrics themselves)."""
        return _client().generate_latest(self.registry)  # type: ignore[no-any-return]


def serve_metrics(port: int, registry: Any, *, addr: str = "127.0.0.1") -> Any:
    """Serve `registry` on http://addr:port/metrics from a daemon thread; return the server
    (`server.server_port` is the port bound, useful with port 0; `server.shutdown()` stops it)."""
    pc = _client()
    server, _thread = pc.start_http_server(port, addr=addr, registry=registry)
    return server
