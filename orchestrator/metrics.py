"""Prometheus metrics for a running daemon: ``triptych metrics --port 9464``.

An exporter beside the daemon, not inside it: each scrape asks the daemon's control socket
for one ``Stats`` snapshot and renders it, so the daemon's loop carries no HTTP server and
a slow or stuck scraper cannot touch it. A daemon that does not answer in time is
``triptych_up 0`` with nothing else, never a hung scrape.
"""

from __future__ import annotations

import itertools
import signal
from collections.abc import Callable, Iterator

import structlog
from prometheus_client import start_http_server
from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from actors.states import ACTIVE_BY_ROLE
from orchestrator.early_signals import STOP_SIGNALS
from orchestrator.log import Throttled
from orchestrator.rejection import Rejection
from transfer.protocol import LATENCY_BOUNDS_MS, ROLES, Latency, Reason, Stats, hop_name, next_role

log = structlog.get_logger()

SERVER_STOP_S = 5.0  # for the HTTP server's thread to end its last scrape

INSTANCE_LABELS = ["instance", "role", "name"]
NO_REASONS = {str(reason): 0 for reason in Reason}
NO_HOPS = {hop_name(role, following): 0 for role in ROLES if (following := next_role(role)) is not None}


class StatsCollector:
    """A prometheus_client collector over ``read_stats`` (``Control(...).stats``)."""

    def __init__(self, read_stats: Callable[[], Stats]) -> None:
        self._read_stats = read_stats
        self._log = Throttled(log)

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("triptych_up", "1 if the daemon answered this scrape's stats query")
        try:
            stats = self._read_stats()
        except (TimeoutError, ConnectionError, Rejection, ValueError) as exc:
            # No answer in time, no daemon, the daemon too busy to gather one, or something
            # else answering there (a daemon restarted with other endpoints): down, never an
            # HTTP 500.
            if not isinstance(exc, TimeoutError | ConnectionError):
                self._log.warning("metrics.no_stats", error=str(exc))
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from _daemon_metrics(stats)
        yield from _latency_metrics(stats)
        yield from _instance_metrics(stats)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _labelled(family: type[GaugeMetricFamily | CounterMetricFamily], name: str, doc: str, label: str,
              values: dict[str, int]) -> Metric:
    """One sample per key of ``values``, the key as the ``label``."""
    metric = family(name, doc, labels=[label])
    for key, value in sorted(values.items()):
        metric.add_metric([key], value)
    return metric


def _daemon_metrics(stats: Stats) -> Iterator[Metric]:
    yield _gauge("triptych_uptime_seconds", "Seconds since the daemon started", stats.uptime_s)
    yield _gauge("triptych_draining", "1 while the daemon drains and refuses new requests", int(stats.draining))
    yield CounterMetricFamily("triptych_requests_completed", "Requests answered with a result", value=stats.completed)
    # Every reason and hop from the start, 0 until its first event: a series that first
    # appears at 1 is missed by an alert on its increase (a daemon's first worker_lost).
    yield _labelled(CounterMetricFamily, "triptych_requests_failed",
                    "Failed attempts of requests by reason: an end in an error, and each attempt retried",
                    "reason", NO_REASONS | stats.failed_by_reason)
    yield _labelled(CounterMetricFamily, "triptych_requests_refused",
                    "Client messages refused at the door: submits never admitted (overloaded, draining...), "
                    "unreadable ones, by reason", "reason",
                    NO_REASONS | stats.refused)
    yield CounterMetricFamily("triptych_requests_retried",
                              "Requests started again after a lost worker or a failed hand-off",
                              value=stats.retried)
    yield CounterMetricFamily("triptych_replies_dropped",
                              "Replies not sent: the client had left or was not reading its replies",
                              value=stats.replies_dropped)
    # Every state, 0 when empty: a series that vanishes when idle breaks sums and alerts.
    yield _labelled(GaugeMetricFamily, "triptych_requests_in_flight",
                    "Requests in flight, by state: a stage's from the hand-off into it to the hand-off out of it, "
                    "a wait for the next stage's slot included", "state",
                    {state: 0 for state in ACTIVE_BY_ROLE.values()} | stats.requests_by_state)
    yield _labelled(GaugeMetricFamily, "triptych_queue_depth", "Jobs waiting for a free slot, by role", "role",
                    stats.queue_depths)
    yield _gauge("triptych_handoffs_in_flight", "Outputs staged and not yet handed to the next stage: waiting for "
                 "its slot, or being written", stats.handoffs_in_flight)
    yield _gauge("triptych_handoffs_held", "Hand-offs of ended requests whose receiver memory waits for the push "
                 "to report (or push_quarantine_s)", stats.handoffs_held)
    handoffs = CounterMetricFamily("triptych_handoffs", "Hand-offs made, by hop and path (fast: a preallocated slot)",
                                   labels=["hop", "path"])
    for path, counts in (("fast", stats.fast_path), ("slow", stats.slow_path)):
        for hop, count in sorted((NO_HOPS | counts).items()):
            handoffs.add_metric([hop, path], count)
    yield handoffs
    yield CounterMetricFamily("triptych_late_reports",
                              "Worker reports dropped: about requests that had already ended, "
                              "or not the sender's to make",
                              value=stats.late_reports)
    yield _labelled(GaugeMetricFamily, "triptych_mailbox_peak", "The most mail an actor's mailbox held at once",
                    "actor", stats.mailboxes)
    yield _labelled(CounterMetricFamily, "triptych_mail_handled",
                    "Mail each actor has handled: the daemon's internal hops", "actor", stats.mail_handled)


def _add_latency(family: HistogramMetricFamily, labels: list[str], latency: Latency) -> None:
    """``latency``'s buckets as Prometheus's: cumulative, in seconds, the last one +Inf."""
    bounds = [f"{bound / 1000:g}" for bound in LATENCY_BOUNDS_MS] + ["+Inf"]
    family.add_metric(labels, list(zip(bounds, itertools.accumulate(latency.counts), strict=True)),
                      sum_value=latency.total_ms / 1000)


def _latency_metrics(stats: Stats) -> Iterator[Metric]:
    request = HistogramMetricFamily("triptych_request_duration_seconds",
                                    "Completed requests, from the daemon taking the submit to the result")
    stages = HistogramMetricFamily("triptych_stage_duration_seconds",
                                   "Each stage of each request: queued (for the role's slot, its input waiting "
                                   "included, then for a compute thread) "
                                   "and compute", labels=["role", "part"])
    hops = HistogramMetricFamily("triptych_handoff_duration_seconds",
                                 "Each hand-off's write from one stage's worker into the next's", labels=["hop"])
    for key, latency in sorted(stats.latency.items()):
        if len(latency.counts) != len(LATENCY_BOUNDS_MS) + 1:
            continue  # a daemon with other bounds: its buckets would be mislabelled here
        if key == "request":
            _add_latency(request, [], latency)
        elif "->" in key:
            _add_latency(hops, [key], latency)
        else:
            role, part = key.split(".")
            _add_latency(stages, [role, part], latency)
    yield from (request, stages, hops)
    yield _labelled(CounterMetricFamily, "triptych_handoff_bytes",
                    "Bytes written worker to worker, by hop (over the hop's duration: its bandwidth)", "hop",
                    NO_HOPS | stats.handoff_bytes)


def _instance_metrics(stats: Stats) -> Iterator[Metric]:
    families = {
        "slots_free": GaugeMetricFamily("triptych_worker_slots_free", "Free capacity slots", labels=INSTANCE_LABELS),
        "slots_total": GaugeMetricFamily("triptych_worker_slots", "Capacity slots", labels=INSTANCE_LABELS),
        "slots_finishing": GaugeMetricFamily("triptych_worker_slots_finishing",
                                             "Slots held by stage runs of requests that ended, until those runs end",
                                             labels=INSTANCE_LABELS),
        "prealloc_free": GaugeMetricFamily("triptych_worker_prealloc_free", "Free preallocated receive slots",
                                           labels=INSTANCE_LABELS),
        "prealloc_total": GaugeMetricFamily("triptych_worker_prealloc", "Preallocated receive slots",
                                            labels=INSTANCE_LABELS),
        "served": CounterMetricFamily("triptych_worker_served", "Stages this instance completed",
                                      labels=INSTANCE_LABELS),
        "failed": CounterMetricFamily("triptych_worker_failed", "Stages that failed on this instance",
                                      labels=INSTANCE_LABELS),
        "suspect": GaugeMetricFamily("triptych_worker_suspect",
                                     "1 while it gets no new work: not yet reached, silent, stopping, a push "
                                     "into it failed and not heard from since, or a push of its is overdue",
                                     labels=INSTANCE_LABELS),
    }
    for inst in stats.instances:
        labels = [inst.instance, inst.role, inst.name]
        for field, family in families.items():
            family.add_metric(labels, getattr(inst, field))
    yield from families.values()


def serve_metrics(read_stats: Callable[[], Stats], port: int, host: str = "127.0.0.1", *,
                  listening: Callable[[str], None] = lambda url: None) -> None:
    """Serve ``/metrics`` on ``host:port`` until SIGTERM or SIGINT. ``listening`` gets the
    page's URL once the socket is bound; an address that cannot be bound raises ``OSError``
    naming it."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(read_stats))
    stop = set(STOP_SIGNALS)
    # Blocked before the server's thread starts, so that thread inherits the mask and the
    # signal waits for sigwait here instead of interrupting a scrape.
    caller_mask = signal.pthread_sigmask(signal.SIG_BLOCK, stop)
    try:
        try:
            server, thread = start_http_server(port, addr=host, registry=registry)
        except OSError as exc:  # the socket's own words name no address ("Address already in use")
            raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        try:
            listening(f"http://{host}:{server.server_port}/metrics")  # the bound port, should it be 0
            signal.sigwait(stop)
        finally:
            server.shutdown()
            thread.join(timeout=SERVER_STOP_S)
            if thread.is_alive():  # a daemon thread: it dies with the process, but say so
                log.warning("metrics.server_lingers", waited_s=SERVER_STOP_S)
    finally:
        # Unblocked again, above all after a failed bind: the caller's Ctrl-C must still work.
        signal.pthread_sigmask(signal.SIG_SETMASK, caller_mask)
