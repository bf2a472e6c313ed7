"""``serve(cfg)``: the daemon. Makes the mailboxes, starts every actor in one task group,
handles signals and drains.

Mail flow for one request (fast path on both hops)::

    client -> frontend -> tracker -> admission -> pool[encoder] -> negotiator
    negotiator -> pool[encoder] --Work--> encoder --Staged--> negotiator -> admission -> pool[denoiser] -> negotiator
    negotiator -> pool[encoder] --Push--> encoder --Pushed--> negotiator
    negotiator -> pool[denoiser] --Ready--> denoiser ... (same hop to the decoder)
    decoder --Done+frames--> negotiator -> tracker -> frontend -> client
"""

from __future__ import annotations

import signal
import time
from typing import Any

import anyio
import msgspec
import structlog
import zmq.asyncio

from actors.admission import AdmissionActor
from actors.base import ask_stats
from actors.control import ControlActor
from actors.frontend import FrontendActor
from actors.mail import EndAll, Farewell, SetDraining, StartDrain, Tick
from actors.mailbox import Mailbox, Switchboard
from actors.negotiator import TransferNegotiator
from actors.pools import PoolActor
from actors.tracker import TrackerActor
from orchestrator.config import Config
from orchestrator.early_signals import STOP_SIGNALS
from transfer.protocol import ROLES
from transfer.reports import REPORTS_PER_MESSAGE
from transfer.sockets import PUMP_BATCH

log = structlog.get_logger()

TRACKER_TICK_S = 0.02  # deadline resolution
END_ALL_FLUSH_S = 1.0  # for the answers to requests a timed-out drain ends, and for the farewell


async def tick(outbox: Mailbox[Any], period_s: float) -> None:
    """Post a ``Tick`` every ``period_s``, or at once when the last one's work (delivered
    as it is posted: a mass of expiries, say) took longer than that."""
    last = time.monotonic()
    while True:
        await anyio.sleep(max(0.0, last + period_s - time.monotonic()))
        now = time.monotonic()
        outbox.post(Tick(gap_s=now - last))
        last = now


async def serve(cfg: Config, *, early: list[signal.Signals] | None = None, own_process: bool = False,
                task_status: anyio.abc.TaskStatus[dict[str, str]] = anyio.TASK_STATUS_IGNORED) -> None:
    """Run until drained (signal or ``Drain``) or cancelled. Reports bound endpoints when ready.
    ``early``: stop signals kept since the process started (``early_signals.keep``).
    ``own_process``: the process is the daemon's alone (``triptych serve``): once the daemon
    stops watching for stop signals, it ignores them."""
    drain_requested = anyio.Event()
    # A second signal cuts the drain short: what is still in flight is answered and the
    # workers are told, as when the drain runs out of time.
    drain_wait = anyio.CancelScope()
    async with anyio.create_task_group() as signals:
        # Signals are watched until the actors have stopped, their sockets' last answers
        # sent: a second signal during that (bounded) teardown is one more "stop at once",
        # not the end of the process before its answers leave.
        signals.start_soon(_watch_signals, drain_requested, drain_wait, [] if early is None else early, own_process)
        await _serve(cfg, drain_requested, drain_wait, task_status=task_status)
        signals.cancel_scope.cancel()


async def _serve(cfg: Config, drain_requested: anyio.Event, drain_wait: anyio.CancelScope, *,
                 task_status: anyio.abc.TaskStatus[dict[str, str]]) -> None:
    d = cfg.daemon
    settings = msgspec.to_builtins(cfg)
    settings["daemon"]["token"] = "<redacted>"  # logs travel further than the config file
    log.info("daemon.config", **settings)
    # Every mailbox holds more than the mail the daemon can have in flight: a handful per
    # admitted request, and admission stops at max_in_flight (see actors/mailbox.py); plus a
    # piece of mail for every report one batch of the worker socket's reader can bring
    # (a late report's abort), which no admission bounds.
    size = d.mailbox_headroom + 8 * d.max_in_flight + PUMP_BATCH * REPORTS_PER_MESSAGE
    ctx = zmq.asyncio.Context()
    # A PUSH to each worker, a registration's probe, the three ROUTERs and their monitors:
    # ZMQ's default of 1,023 sockets would cut off a large cluster in mid-registration.
    ctx.setsockopt(zmq.MAX_SOCKETS, 2 * d.max_workers + 64)
    board = Switchboard()
    fe, tr, ad, ng = (board.mailbox(name, size) for name in ("frontend", "tracker", "admission", "negotiator"))
    pools = {role: board.mailbox(f"pool.{role}", size) for role in ROLES}
    try:
        async with anyio.create_task_group() as tg:
            negotiator = TransferNegotiator(ng, ctx=ctx, cfg=d, pools=pools, admission=ad, tracker=tr, frontend=fe)
            endpoints = {"worker": await tg.start(negotiator.run)}
            for role, inbox in pools.items():
                pool = PoolActor(role, inbox, ctx=ctx, policy=d.dispatch, send_hwm=d.worker_send_hwm,
                                 admission=ad, tracker=tr, negotiator=ng)
                await tg.start(pool.run)
            await tg.start(AdmissionActor(ad, pools, tr).run)
            await tg.start(TrackerActor(tr, frontend=fe, admission=ad).run)
            owners = {"frontend": fe, "tracker": tr, "admission": ad, "negotiator": ng,
                      **{f"pool.{role}": inbox for role, inbox in pools.items()}}
            control = ControlActor(ctx=ctx, endpoint=d.control_endpoint, owners=owners,
                                   drain_requested=drain_requested)
            endpoints["control"] = await tg.start(control.run)
            endpoints["client"] = await tg.start(FrontendActor(fe, ctx=ctx, cfg=d, tracker=tr).run)
            tg.start_soon(tick, tr, TRACKER_TICK_S)
            tg.start_soon(tick, ng, d.heartbeat_s / 2)
            tg.start_soon(_drain_on_request, tg.cancel_scope, drain_requested, drain_wait, fe, tr, ng,
                          d.drain_timeout_s)
            log.info("daemon.ready", **endpoints)
            task_status.started(endpoints)
    finally:
        ctx.destroy(linger=0)  # every socket, even one an actor's crash left open: a bounded stop
    log.info("daemon.stopped")


async def _watch_signals(drain_requested: anyio.Event, drain_wait: anyio.CancelScope,
                         early: list[signal.Signals], ignore_after: bool) -> None:
    try:
        await _act_on_signals(drain_requested, drain_wait, early)
    finally:
        if ignore_after:
            # The receiver, closing, gave the signals back their default action, which would
            # kill the process before its last answers leave (a second signal while the
            # daemon stops is one more "stop at once", the docs say, and it is stopping).
            for signum in STOP_SIGNALS:
                signal.signal(signum, signal.SIG_IGN)


async def _act_on_signals(drain_requested: anyio.Event, drain_wait: anyio.CancelScope,
                          early: list[signal.Signals]) -> None:
    signalled = False

    def heard(signum: int, *, during_start_up: bool = False) -> bool:
        """Act on a stop signal; True once there is nothing left to act on. A control
        ``Drain`` before it is no signal: the SIGTERM a supervisor sends after running
        `triptych drain` (a preStop hook, `systemctl stop`) lets that drain go on."""
        nonlocal signalled
        log.info("daemon.signal", signal=signal.Signals(signum).name, during_start_up=during_start_up,
                 draining=drain_requested.is_set())
        if signalled:
            drain_wait.cancel()  # second signal: stop waiting for the work in flight
            return True
        signalled = True
        drain_requested.set()
        return False

    with anyio.open_signal_receiver(*STOP_SIGNALS) as signals:
        # Those kept before this receiver opened count as if they came now.
        if any(heard(signum, during_start_up=True) for signum in early):
            return
        async for signum in signals:
            if heard(signum):
                return


async def _drain_on_request(
    scope: anyio.CancelScope,
    drain_requested: anyio.Event,
    drain_wait: anyio.CancelScope,
    frontend: Mailbox[Any],
    tracker: Mailbox[Any],
    negotiator: Mailbox[Any],
    timeout_s: float,
) -> None:
    """On the first signal or ``Drain``: refuse new work, let in-flight work finish, tell
    the workers, stop. A second signal (``drain_wait`` cancelled) ends the wait at once."""
    await drain_requested.wait()
    with anyio.move_on_after(timeout_s) as waited, drain_wait:
        frontend.post(SetDraining())
        drained = anyio.Event()
        tracker.post(StartDrain(drained=drained))
        await drained.wait()
        # Once the frontend answers a query, the last results posted before the drain
        # completed have been handed to its socket.
        await ask_stats(frontend)
    if waited.cancelled_caught or drain_wait.cancelled_caught:
        cut_short = drain_wait.cancelled_caught
        log.warning("daemon.drain_cut_short" if cut_short else "daemon.drain_timeout", timeout_s=timeout_s)
        why = "it was told to stop at once (a second signal)" if cut_short else (
            f"its drain ran out of time (drain_timeout_s = {timeout_s:g})")
        # Every request still in flight gets its final answer before the sockets close.
        tracker.post(EndAll(message=f"the daemon stopped before this request finished: {why}"))
        with anyio.move_on_after(END_ALL_FLUSH_S):
            await ask_stats(frontend)
    else:
        log.info("daemon.drained")
    # Workers rejoin the next daemon at once, instead of when their heartbeats meet it, and
    # those nothing is being written into skip push_quarantine_s (the answer flushes as the
    # worker socket closes).
    negotiator.post(Farewell())
    with anyio.move_on_after(END_ALL_FLUSH_S) as farewell:
        await ask_stats(negotiator)
    if farewell.cancelled_caught:
        log.warning("daemon.farewell_unconfirmed", waited_s=END_ALL_FLUSH_S)
    scope.cancel()
