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
from contextlib import ExitStack
from typing import Any

import anyio
import msgspec
import structlog
import zmq.asyncio
from anyio.abc import ObjectSendStream

from actors.admission import AdmissionActor
from actors.base import ask_stats
from actors.control import ControlActor
from actors.frontend import FrontendActor
from actors.mail import SetDraining, StartDrain, Tick
from actors.negotiator import TransferNegotiator
from actors.pools import PoolActor
from actors.tracker import TrackerActor
from orchestrator.config import Config
from transfer.protocol import ROLES

log = structlog.get_logger()

TRACKER_TICK_S = 0.02  # deadline resolution


async def _tick(outbox: ObjectSendStream[Any], period_s: float) -> None:
    with outbox:
        while True:
            await anyio.sleep(period_s)
            await outbox.send(Tick())


async def serve(cfg: Config, *, task_status: anyio.abc.TaskStatus[dict[str, str]] = anyio.TASK_STATUS_IGNORED) -> None:
    """Run until drained (signal or ``Drain``) or cancelled. Reports bound endpoints when ready."""
    d = cfg.daemon
    log.info("daemon.config", **msgspec.to_builtins(cfg))
    # Every mailbox holds more than the mail the daemon can have in flight: a handful per
    # admitted request, and admission stops at max_in_flight (see actors/base.py).
    size = d.mailbox_size + 8 * d.max_in_flight
    ctx = zmq.asyncio.Context()
    drain_requested = anyio.Event()
    try:
        async with anyio.create_task_group() as tg:
            fe_tx, fe_rx = anyio.create_memory_object_stream(size)
            tr_tx, tr_rx = anyio.create_memory_object_stream(size)
            ad_tx, ad_rx = anyio.create_memory_object_stream(size)
            ng_tx, ng_rx = anyio.create_memory_object_stream(size)
            pool_streams = {role: anyio.create_memory_object_stream(size) for role in ROLES}
            pools_tx = {role: tx for role, (tx, _) in pool_streams.items()}
            # Actors get clones; the originals close once all are handed out, so each
            # inbox ends when its last sender goes.
            with ExitStack() as originals:
                for tx in (fe_tx, tr_tx, ad_tx, ng_tx, *pools_tx.values()):
                    originals.enter_context(tx)
                negotiator = TransferNegotiator(ng_rx, ctx=ctx, cfg=d, pools=_clones(pools_tx), admission=ad_tx.clone(),
                                                tracker=tr_tx.clone(), frontend=fe_tx.clone())
                endpoints = {"worker": await tg.start(negotiator.run)}
                for role, (_, rx) in pool_streams.items():
                    pool = PoolActor(role, rx, ctx=ctx, policy=d.dispatch, send_hwm=d.worker_send_hwm,
                                     admission=ad_tx.clone(), tracker=tr_tx.clone(), negotiator=ng_tx.clone())
                    await tg.start(pool.run)
                await tg.start(AdmissionActor(ad_rx, _clones(pools_tx)).run)
                await tg.start(TrackerActor(tr_rx, frontend=fe_tx.clone(), admission=ad_tx.clone()).run)
                owners = {"frontend": fe_tx.clone(), "tracker": tr_tx.clone(), "admission": ad_tx.clone(),
                          "negotiator": ng_tx.clone(), **{f"pool.{r}": tx.clone() for r, tx in pools_tx.items()}}
                control = ControlActor(ctx=ctx, endpoint=d.control_endpoint, owners=owners,
                                       drain_requested=drain_requested)
                endpoints["control"] = await tg.start(control.run)
                endpoints["client"] = await tg.start(FrontendActor(fe_rx, ctx=ctx, cfg=d, tracker=tr_tx.clone()).run)
                tg.start_soon(_tick, tr_tx.clone(), TRACKER_TICK_S)
                tg.start_soon(_tick, ng_tx.clone(), d.heartbeat_s / 2)
                tg.start_soon(_drain_on_request, tg.cancel_scope, drain_requested, fe_tx.clone(), tr_tx.clone(),
                              d.drain_timeout_s)
                tg.start_soon(_watch_signals, tg.cancel_scope, drain_requested)
            log.info("daemon.ready", **endpoints)
            task_status.started(endpoints)
    finally:
        ctx.term()
    log.info("daemon.stopped")


def _clones(streams: dict[Any, ObjectSendStream[Any]]) -> dict[Any, ObjectSendStream[Any]]:
    return {key: stream.clone() for key, stream in streams.items()}


async def _watch_signals(scope: anyio.CancelScope, drain_requested: anyio.Event) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("daemon.signal", signal=signal.Signals(signum).name)
            if drain_requested.is_set():
                scope.cancel()  # second signal: stop now
                return
            drain_requested.set()


async def _drain_on_request(
    scope: anyio.CancelScope,
    drain_requested: anyio.Event,
    frontend: ObjectSendStream[Any],
    tracker: ObjectSendStream[Any],
    timeout_s: float,
) -> None:
    """On the first signal or ``Drain``: refuse new work, let in-flight work finish, stop."""
    with frontend, tracker:
        await drain_requested.wait()
        with anyio.move_on_after(timeout_s) as waited:
            await frontend.send(SetDraining())
            drained = anyio.Event()
            await tracker.send(StartDrain(drained=drained))
            await drained.wait()
            # Once the frontend answers a query, the last results posted before the drain
            # completed have been handed to its socket.
            await ask_stats(frontend)
        if waited.cancelled_caught:
            log.warning("daemon.drain_timeout", timeout_s=timeout_s)
        else:
            log.info("daemon.drained")
    scope.cancel()
