"""Live metrics for Prometheus: an instrument that counts, and an HTTP endpoint that reads.

`PrometheusInstrument` implements the instrument hooks (telemetry/instruments.py). Its hooks only
bump plain Python numbers (a dict update, ~0.1 us, on the loop thread); a custom collector turns
them into metric families when Prometheus scrapes (the scrape thread copies the dicts, which is
atomic under the GIL for int and str keys). So scraping never touches the event loop and the hot
path takes no lock. Per rank: tasks run (by kind), messages and bytes sent, activations in flight
(live), busy fraction of the last step; per step: step time, bubble fraction, efficiency.
`serve_metrics(port, registry)` serves it from a daemon thread (prometheus_client's server).
Under mpirun each rank serves its own on port + rank. Needs the `telemetry` extra.
"""

from __future__ import annotations

from typing import Any, Iterator

from ..devices.base import TaskInfo
from ..errors import ConfigError
from ..tasks import Kind
from ..transports.base import Message
from .metrics import StepMetrics
from .spans import StepReport

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
    """Counters of a run, exposed through their own CollectorRegistry (no global state)."""

    def __init__(self, registry: Any = None, *, split_backward: bool = False) -> None:
        pc = _client()
        self.registry = registry if registry is not None else pc.CollectorRegistry()
        self._last_kind = Kind.W if split_backward else Kind.B  # frees the in-flight slot
        self.tasks: dict[tuple[int, str], int] = {}
        self.messages: dict[int, int] = {}
        self.bytes: dict[int, int] = {}
        self.in_flight: dict[int, int] = {}
        self.busy: dict[int, float] = {}
        self.last: StepMetrics | None = None
        self.num_steps = 0
        self.registry.register(_Collector(self))

    def before_task(self, info: TaskInfo) -> None:
        if info.kind is Kind.F and info.chunk == 0:
            self.in_flight[info.rank] = self.in_flight.get(info.rank, 0) + 1

    def after_task(self, info: TaskInfo, start: float, end: float) -> None:
        key = (info.rank, info.kind.name)
        self.tasks[key] = self.tasks.get(key, 0) + 1
        if info.chunk == 0 and info.kind is self._last_kind:
            self.in_flight[info.rank] -= 1

    def message_sent(self, rank: int, dest: int, msg: Message, nbytes: int) -> None:
        self.messages[rank] = self.messages.get(rank, 0) + 1
        self.bytes[rank] = self.bytes.get(rank, 0) + nbytes

    def after_step(self, report: StepReport, metrics: StepMetrics) -> None:
        """Per-step gauges; a report holding only some ranks (one MPI rank's) sets only theirs,
        and step-wide figures only when every rank is in it."""
        ranks = {s.rank for s in report.spans}
        for rank in ranks:
            self.busy[rank] = metrics.busy_fraction[rank]
        if len(ranks) == report.num_ranks:
            self.last = metrics
        self.num_steps += 1

    def exposition(self) -> bytes:
        """The metrics in Prometheus text format (for services that serve /metrics themselves)."""
        return _client().generate_latest(self.registry)  # type: ignore[no-any-return]


class _Collector:
    """Builds the metric families from the instrument's numbers at scrape time."""

    def __init__(self, inst: PrometheusInstrument) -> None:
        self.inst = inst

    def describe(self) -> list[Any]:
        return []  # families are built per scrape; nothing to check at registration

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        i = self.inst
        tasks = CounterMetricFamily("aioready_tasks", "tasks run", labels=["rank", "kind"])
        for (rank, kind), n in sorted(dict(i.tasks).items()):
            tasks.add_metric([str(rank), kind], n)
        yield tasks
        for name, doc, values in (("aioready_messages_sent", "messages sent", i.messages),
                                  ("aioready_bytes_sent", "payload bytes sent", i.bytes)):
            fam = CounterMetricFamily(name, doc, labels=["rank"])
            for rank, n in sorted(dict(values).items()):
                fam.add_metric([str(rank)], n)
            yield fam
        for name, doc, values in (
                ("aioready_activations_in_flight", "microbatches holding activations on a "
                 "rank now", i.in_flight),
                ("aioready_busy_fraction", "share of the last step a rank's device was busy",
                 i.busy)):
            gauge = GaugeMetricFamily(name, doc, labels=["rank"])
            for rank, v in sorted(dict(values).items()):
                gauge.add_metric([str(rank)], v)
            yield gauge
        yield CounterMetricFamily("aioready_steps", "steps finished", value=i.num_steps)
        last = i.last
        for name, doc, attr in (("aioready_step_time_seconds", "time of the last step",
                                 "step_time"),
                                ("aioready_efficiency", "lower bound / step time of the last "
                                 "step", "efficiency"),
                                ("aioready_bubble_fraction", "idle share of the last step",
                                 "bubble_fraction")):
            yield GaugeMetricFamily(name, doc, value=getattr(last, attr) if last else 0.0)


IDLE_TIMEOUT_S = 10.0  # a connection that sends nothing for this long is closed


def serve_metrics(port: int, registry: Any, *, addr: str = "127.0.0.1",
                  idle_timeout: float = IDLE_TIMEOUT_S) -> Any:
    """Serve `registry` on http://addr:port/metrics from a daemon thread; return the server
    (`server.server_port` is the port bound, useful with port 0; `server.shutdown()` stops it).
    A connection idle for `idle_timeout` seconds is closed (each holds a thread)."""
    pc = _client()
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError("metrics port out of range", expected="0..65535 (0: any free port)",
                          got=port)
    import threading
    from wsgiref.simple_server import make_server

    handler = type("_Handler", (_QuietHandler,), {"timeout": idle_timeout})
    try:
        server = make_server(addr, port, pc.make_wsgi_app(registry), _Server,
                             handler_class=handler)
    except OSError as exc:
        raise ConfigError(f"cannot serve metrics on {addr}:{port}", expected="a free port",
                          got=exc.strerror or str(exc),
                          fix="choose another --metrics-port (or 0 for any free one)") from None
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _server_classes() -> tuple[type, type]:
    import sys
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

    class Quiet(WSGIRequestHandler):
        def log_message(self, *args: Any) -> None:  # scrapes are not news
            pass

    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True

        def handle_error(self, request: Any, client_address: Any) -> None:
            if isinstance(sys.exc_info()[1], (TimeoutError, ConnectionError)):
                return  # an idle or vanished client, dropped on purpose
            super().handle_error(request, client_address)

    return Quiet, Server


_QuietHandler, _Server = _server_classes()
