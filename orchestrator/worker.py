"""The worker process: register with the daemon, then run one stage for many requests.

Three paths that never wait on each other:

* compute: the stage's synchronous torch code, in ``compute_threads`` worker threads
  (orchestrator/stage_runner.py);
* transfer: Mooncake writes on a worker thread, one at a time (a limiter of 1), or a plain
  copy when the receiver shares this host (orchestrator/worker_memory.py, which owns what
  the worker holds for requests);
* control: allocations, aborts and all socket traffic, on the event loop.

So an ``Alloc`` or ``Push`` is answered while a long denoising loop runs. A stage that
never returns ends the process (orchestrator/watchdog.py).
"""

from __future__ import annotations

import asyncio
import hmac
import os
import secrets
import signal
import socket
import time
from functools import partial
from typing import Any, assert_never

import anyio
import structlog
import torch
import zmq
import zmq.asyncio

from orchestrator.config import Config
from orchestrator.daemon_link import LEAVING_LINGER_MS, DaemonLink
from orchestrator.early_signals import STOP_SIGNALS
from orchestrator.endpoints import dial_problem
from orchestrator.log import Throttled
from orchestrator.own_addresses import check_own_addresses
from orchestrator.stage_runner import StageRunner
from orchestrator.stages import RunControl, build_stage
from orchestrator.watchdog import EXIT_STAGE_HUNG
from orchestrator.work_socket import bind_work_socket, close_work_socket
from orchestrator.worker_memory import RequestMemory
from orchestrator.worker_registration import register, watch_daemon
from transfer.binding import EndpointUnusable, remove_ipc_file
from transfer.engine import Engine, MooncakeEngine
from transfer.pool import MemoryPool, PoolUnallocatable, physical_memory
from transfer.protocol import (
    DAEMON_STOPPING,
    DECODE_ERRORS,
    ORDERS_PER_MESSAGE,
    PROTOCOL_VERSION,
    WORK_ORDER,
    Abort,
    Alloc,
    Done,
    Heartbeat,
    Probe,
    Probed,
    Push,
    Ready,
    Reason,
    Register,
    Registered,
    RegisterRefused,
    Role,
    Stopped,
    Stopping,
    Work,
    WorkOrder,
    encode,
)
from transfer.reports import ReportOutbox
from transfer.shm import LocalWriter, SharedRegion, shared_region
from transfer.sockets import PlainPump

log = structlog.get_logger()

# How long a hung stage's exit waits for the event loop to report it and say Leaving
# (WorkerRuntime._stage_hung): past it the loop is taken to hang too.
HUNG_EXIT_GRACE_S = LEAVING_LINGER_MS / 1000 + 2.0


class WorkerRuntime:
    """Owns one stage runner, one registered memory pool, one engine, its work socket and its link to the daemon."""

    def __init__(self, role: Role, cfg: Config, *, name: str | None = None, engine: Engine | None = None) -> None:
        self.role = role
        self._cfg = cfg
        self._wcfg = cfg.workers.for_role(role)
        # A default name must never match another live worker's: containers sharing the
        # host's network (and so its hostname) each have their own pid 1.
        self.name = name or f"{role}@{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self._engine = engine
        self._pool: MemoryPool | None = None
        # Same-host copies (transfer.same_host_copy): the pool in shared memory, advertised.
        self._region: SharedRegion | None = None
        self._memory: RequestMemory | None = None  # once the pool and the engine exist
        self._outbox = ReportOutbox()  # for the main connection to the daemon
        self._outputs = ReportOutbox()  # a decoder's, for its output connection (orchestrator/daemon_link.py)
        self._key = b""
        self._scopes: dict[str, anyio.CancelScope] = {}  # compute and alloc tasks, by request
        self._runs: dict[str, RunControl] = {}  # stage runs, by request: stopped, they end at their next step
        self._owed: dict[anyio.CancelScope, Stopped] = {}  # said once the task of that scope has ended
        self._log = log.bind(role=role, worker=self.name)
        self._peer_log = Throttled(self._log)  # what anyone reaching the work socket can make it say
        self._work_address: str | None = None  # once bound
        self._daemon_link: DaemonLink | None = None  # once created
        self._runner = StageRunner(role, self._wcfg, log=self._log,
                                   max_message_bytes=cfg.daemon.worker_max_message_bytes, report=self._report,
                                   on_hung=self._stage_hung, exit_after_reports=self._exit_after_reports)
        self._loop: asyncio.AbstractEventLoop | None = None  # once running: where the watchdog's thread calls in

    # ------------------------------------------------------------------ lifecycle

    async def run(self, *, task_status: anyio.abc.TaskStatus[str] = anyio.TASK_STATUS_IGNORED) -> None:
        self._check_settings()
        await self._load_stage()
        self._make_memory()
        link = self._daemon_link = DaemonLink(self._cfg.daemon.worker_endpoint)
        work = link.ctx.socket(zmq.PULL, socket_class=zmq.Socket)  # plain: read by a PlainPump
        work.setsockopt(zmq.LINGER, 0)
        registered: Registered | None = None
        try:
            self._work_address = work_address = bind_work_socket(work, self._wcfg)
            link.connect()
            registered = await self._register(link.main, work_address, patient=False)
            task_status.started(registered.instance)
            while True:
                forgotten = await self._serve(registered, link, work, work_address)
                registered = None  # forgotten: a Leaving would go to no one (and wait out its linger)
                link.close_outputs()
                await self._forget_everything(forgotten)
                registered = await self._register(link.main, work_address, patient=True)
        finally:
            close_work_socket(work, self._work_address)
            # Stage and push threads have all ended here (_serve's task group waited for
            # them), so the daemon may free at once what this worker held or was sent.
            with anyio.CancelScope(shield=True):  # this runs as the stop cancels everything
                await self._leave(link, registered)
            self._engine.close()

    def _check_settings(self) -> None:
        """Check, before the model loads (minutes, with real weights), the settings that would
        fail later: the daemon's endpoint, this worker's own addresses, the pool's size."""
        if (problem := dial_problem(endpoint := self._cfg.daemon.worker_endpoint)) is not None:
            # The daemon may bind `*`, which no peer can connect to.
            raise EndpointUnusable(f"daemon.worker_endpoint ({endpoint}) is {problem}")
        check_own_addresses(self.role, self._wcfg, self._cfg.transfer)
        if self._wcfg.pool_bytes > (memory := physical_memory()):
            # A pool only near the machine's size fails to allocate (PoolUnallocatable), or
            # the kernel ends the worker as it is touched.
            raise PoolUnallocatable(f"workers.{self.role}.pool_bytes ({self._wcfg.pool_bytes}) is more than this "
                                    f"machine's memory ({memory} bytes)")

    async def _load_stage(self) -> None:
        """Load the stage (``StageRunner.load``: watched, and left to its thread by a stop)."""
        torch.set_num_threads(self._wcfg.torch_threads)
        self._loop = asyncio.get_running_loop()  # before the load starts the watchdog
        await self._runner.load(lambda: build_stage(self.role, self._cfg.model, torch_threads=self._wcfg.torch_threads))

    def _make_memory(self) -> None:
        """The pool, in shared memory for same-host copies where this host allows it,
        registered with the engine (Mooncake's, unless the worker was given one)."""
        receives = self.role != "encoder"
        slot_sizes = [self._wcfg.prealloc_slot_bytes] * self._wcfg.prealloc_slots if receives else []
        writers = None
        if self._cfg.transfer.same_host_copy:
            self._region = shared_region(self._wcfg.pool_bytes)
            # Without a region of its own it is not told of peers' regions either (the daemon
            # pairs shared memory only when both ends have it).
            writers = (LocalWriter(), LocalWriter()) if self._region else None
        pool = MemoryPool(self._wcfg.pool_bytes, slot_sizes=slot_sizes,
                          memory=self._region.tensor if self._region else None)
        if self._engine is None:
            self._engine = MooncakeEngine(self._cfg.transfer)
        self._engine.register(pool.base, pool.size)
        self._use_pool(pool, writers)

    def _adopt(self, registered: Registered) -> None:
        """Take on what the daemon's answer says. Its settings, not this worker's config's:
        each host's copy may differ."""
        assert self._memory is not None
        self._key = registered.key
        self._log = log.bind(role=self.role, worker=self.name, instance=registered.instance)
        self._peer_log = Throttled(self._log)
        self._runner.registered(self._log,
                                registered.max_message_bytes or self._cfg.daemon.worker_max_message_bytes)
        self._memory.registered(self._log, registered.heartbeat_s, registered.push_quarantine_s)

    async def _leave(self, link: DaemonLink, registered: Registered | None) -> None:
        """Say Leaving if this worker is registered and may, then close the link. A decoder
        first hands over the outputs it made, which may take a while to cross (at most
        stop_flush_s); the others give Leaving LEAVING_LINGER_MS to go out."""
        leaving = registered is not None and self._may_say_leaving()
        if leaving and link.outputs is not None:
            assert registered is not None
            outputs = self._outputs.take_now()
            why = await link.hand_over(outputs, heartbeat_s=registered.heartbeat_s, within_s=self._wcfg.stop_flush_s)
            if why is not None and outputs:  # unanswered with nothing to hand over: nothing lost
                self._log.warning("worker.outputs_not_handed_over", why=why, outputs=len(outputs))
            link.close(0)
        else:
            link.close(LEAVING_LINGER_MS if leaving and link.send_now([], [], leaving=True) else 0)

    def _use_pool(self, pool: MemoryPool, writers: tuple[LocalWriter, LocalWriter] | None = None) -> None:
        """Hold requests' memory in ``pool``, registered with the engine."""
        assert self._engine is not None
        self._pool = pool
        self._memory = RequestMemory(pool, self._engine, writers, alloc_timeout_s=self._wcfg.alloc_timeout_s,
                                     push_quarantine_s=self._cfg.daemon.push_quarantine_s, report=self._report)

    def _exit_at_once(self, status: int) -> None:
        """Exit for a supervisor to replace this worker (a hung stage, a broken GPU context):
        at once (a normal exit would wait for a hung stage thread, and skip nothing but the
        cleanup below), leaving no socket file behind. The daemon sees the silence and starts
        the worker's requests again elsewhere."""
        remove_ipc_file(self._work_address)
        os._exit(status)

    def _stage_hung(self, request_id: str) -> None:
        """On the watchdog's thread: ``request_id``'s run outlived stage_timeout_s. On the loop,
        that request fails and the process exits as after a broken device (its reports and
        Leaving sent first, ``EXIT_STAGE_HUNG``); if the loop does not get to it (it may be
        what hangs), the process exits from here regardless."""
        try:
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._fail_hung, request_id)
                time.sleep(HUNG_EXIT_GRACE_S)
        finally:  # a loop already closed (RuntimeError) must not keep the process from exiting
            self._exit_at_once(EXIT_STAGE_HUNG)

    def _fail_hung(self, rid: str) -> None:
        """The hung run's request fails ``stage_failed``, which the daemon does not start again:
        a request that hangs the stage would hang every worker it was retried on. The worker's
        other requests start again elsewhere."""
        control = self._runs.get(rid)
        if control is not None and not control.stopped:  # stopped: the daemon expects no Done
            ran_ms = (time.monotonic() - (control.started_at or time.monotonic())) * 1000
            self._report(Done(request_id=rid, ok=False, compute_ms=ran_ms, reason=Reason.STAGE_FAILED,
                              error=f"the stage ran past workers.{self.role}.stage_timeout_s "
                                    f"({self._wcfg.stage_timeout_s:g} s) and its worker exits"))
        self._exit_after_reports(EXIT_STAGE_HUNG)

    def _exit_after_reports(self, status: int) -> None:
        """``_exit_at_once``, but first send every queued report, then ``Leaving`` if it may
        be said (the daemon starts this worker's other requests again at once, rather than
        sending it work until it falls silent), and wait up to LEAVING_LINGER_MS until ZMQ
        has put them on the wire. On the loop only: it takes the daemon link from under the
        tasks that use it, which never run again."""
        if self._daemon_link is not None:
            self._daemon_link.send_now(self._outbox.take_now(), self._outputs.take_now(),
                                       leaving=self._may_say_leaving())
            self._daemon_link.close(LEAVING_LINGER_MS)
        self._exit_at_once(status)

    def say_stopping(self) -> None:
        """Tell the daemon at once to send no new work: ending the runs under way and
        handing over their outputs may take a while, and work sent meanwhile would wait
        unread until the Leaving that follows."""
        if self._daemon_link is not None:
            self._daemon_link.send_now([[encode(Stopping())]], [], leaving=False)

    def _may_say_leaving(self) -> bool:
        """Leaving tells the daemon no write of ours can still land: false while a push
        runs, and for a while after one we stopped waiting for (the daemon then waits out
        its quarantine instead)."""
        memory = self._memory
        return memory is None or (not memory.writing and time.monotonic() >= memory.in_doubt_until)

    async def _serve(self, registered: Registered, link: DaemonLink, work: zmq.Socket,
                     work_address: str) -> RegisterRefused:
        """Serve one registration; return the refusal that says the daemon no longer knows it."""
        assert self._engine is not None
        self._adopt(registered)
        self._log.info("worker.registered", work_address=work_address, session=self._engine.session)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._heartbeat, registered.heartbeat_s)
            tg.start_soon(self._memory.stalls.run)
            tg.start_soon(self._memory.unmap_gone_receivers)
            tg.start_soon(self._send, self._outbox, link.main)
            if self.role == "decoder":
                tg.start_soon(self._send, self._outputs, link.open_outputs(registered.key))
            tg.start_soon(self._order_reader(work, tg).run)
            try:
                forgotten = await watch_daemon(link.main, link.endpoint)
            finally:
                # Forgotten or shutting down, nobody will read what the running stages
                # make: they end at their next step.
                for control in self._runs.values():
                    control.stop()
            # Leaving the group waits for the stage and push threads to end: no write of
            # ours is in flight after it.
            tg.cancel_scope.cancel()
        return forgotten

    async def _forget_everything(self, forgotten: RegisterRefused) -> None:
        """Free what the registration ``forgotten`` ended held, then wait until rejoining is
        safe. A daemon's farewell is a planned end (a restart, a drain): said, not warned of."""
        assert self._pool is not None and self._memory is not None
        log = self._log.info if forgotten.message == DAEMON_STOPPING else self._log.warning
        log("worker.forgotten", why=forgotten.message)
        self._memory.free_everything()
        # Orders of the registration's last loop turn left these behind: their tasks were
        # cancelled before they ran, and with them the code that would have cleared them.
        # Kept, they would refuse the same request ids as repeats under the next one.
        self._runs.clear()
        self._scopes.clear()
        self._owed.clear()
        self._outbox, self._outputs = ReportOutbox(), ReportOutbox()  # about requests nobody knows any more
        # A sender told to push here before the daemon forgot us may still be writing: the
        # daemon must not hand this memory out again before such a write is over.
        wait_s = 0.0 if self.role == "encoder" or forgotten.settled else self._memory.push_quarantine_s
        log("worker.rejoining", wait_s=wait_s, blocks_held=self._pool.allocated_blocks)
        self._log = self._log.new(role=self.role, worker=self.name)  # no instance until the next registration names one
        await anyio.sleep(wait_s)

    async def _register(self, dealer: zmq.asyncio.Socket, work_address: str, *, patient: bool) -> Registered:
        """Register: within ``connect_timeout_s`` at start (a daemon that never comes is a
        setup mistake), for as long as it takes when rejoining (a worker waits out its
        daemon's restart, as it does a silent daemon)."""
        stage = self._runner.stage
        assert self._pool is not None and stage is not None and self._engine is not None
        hello = Register(
            protocol=PROTOCOL_VERSION, token=self._cfg.daemon.token, role=self.role, name=self.name,
            work_address=work_address, session=self._engine.session, pool_base=self._pool.base,
            pool_size=self._pool.size, slots=self._pool.slots, capacity=self._wcfg.capacity,
            write_timeout_s=self._engine.write_timeout_s,
            local=self._region.describe(self._pool.base, self._pool.size) if self._region else None,
            limits=stage.limits(), model_digest=stage.model_digest(),
        )
        patience = None if patient else (self._wcfg.connect_timeout_s, f"workers.{self.role}.connect_timeout_s")
        return await register(dealer, hello, self._cfg.daemon.worker_endpoint, patience=patience, log=self._log)

    async def _heartbeat(self, period_s: float) -> None:
        beat = encode(Heartbeat())
        while True:
            # Any message is a sign of life: one still waiting to leave will say it. (While
            # the daemon takes none, beats would pile up here without end.)
            if not self._outbox:
                self._outbox.put(beat)
            await anyio.sleep(period_s)

    # ------------------------------------------------------------------ orders

    def _order_reader(self, work: zmq.Socket, tg: anyio.abc.TaskGroup) -> PlainPump:
        """Reads the work socket on the loop without zmq.asyncio (nothing else uses it). Anyone
        who reaches it can send, and its size limit is per frame: past the most the daemon
        sends, a message's frames are dropped unread a batch a turn, so that a message of
        millions of empty frames never holds the loop (and with it heartbeats and pushes)."""
        return PlainPump(work, partial(self._on_orders, tg=tg), copy=True, most_frames=2 + ORDERS_PER_MESSAGE)

    def _on_orders(self, parts: list[bytes], tg: anyio.abc.TaskGroup) -> None:
        """``[key, order, order, ...]``: the daemon sends what it has for this worker at once,
        up to ORDERS_PER_MESSAGE orders a message (the pump reads one frame more, to tell)."""
        if len(parts) < 2 or not hmac.compare_digest(parts[0], self._key):
            self._peer_log.warning("worker.order_refused", why="missing or wrong key")
            return
        if len(parts) > 1 + ORDERS_PER_MESSAGE:
            self._peer_log.warning("worker.too_many_orders", read=ORDERS_PER_MESSAGE)
        for body in parts[1 : 1 + ORDERS_PER_MESSAGE]:
            try:
                order = WORK_ORDER.decode(body)
            except DECODE_ERRORS as exc:
                self._peer_log.warning("worker.bad_order", error=str(exc))
                continue
            self._on_order(order, tg)

    def _on_order(self, order: WorkOrder, tg: anyio.abc.TaskGroup) -> None:
        memory = self._memory
        assert memory is not None
        if isinstance(order, Probe):
            self._log.info("worker.orders_arrive")
            self._report(Probed(instance=order.instance))
            return
        if not isinstance(order, Abort) and self._busy_with(order):
            # The daemon sends each order once: a repeat is a bug there. Any answer would
            # read as one about the live request, so the order is only logged.
            self._log.error("worker.repeated_order", request_id=order.request_id, order=type(order).__name__)
            return
        match order:
            case Work() | Ready():
                rid = order.request_id
                control = self._runs[rid] = RunControl(self._runner.step_reporter(rid) if order.progress else None)
                tg.start_soon(self._guarded, rid, self._cancel_scope(rid),
                              partial(self._run_stage, control=control, memory=memory), order)
            case Alloc():
                tg.start_soon(self._guarded, order.request_id, self._cancel_scope(order.request_id),
                              memory.alloc, order)
            case Push():
                # No Abort cancels a push: the daemon awaits its Pushed. Only the end of the
                # registration does (forgotten or leaving), when the daemon awaits nothing.
                tg.start_soon(memory.push, order, memory.stalls.look())
            case Abort(request_id=rid, ack=ack):
                self._abort(rid, ack)
            case _:
                assert_never(order)

    async def _run_stage(self, order: Work | Ready, *, control: RunControl, memory: RequestMemory) -> None:
        """``StageRunner.run``; the run's control is dropped once it ends."""
        try:
            await self._runner.run(order, control, memory)
        finally:
            if self._runs.get(order.request_id) is control:  # not a later run's, let in by an Abort
                del self._runs[order.request_id]

    def _busy_with(self, order: WorkOrder) -> bool:
        """Whether ``order``'s request already has work or memory here that it would clash
        with (a Ready consumes the allocation its Alloc made; nothing else may overlap)."""
        rid, memory = order.request_id, self._memory
        assert memory is not None
        if isinstance(order, Push):
            return memory.pushing(rid)
        held = rid in self._scopes or rid in self._runs or memory.holds_output(rid)
        return held if isinstance(order, Ready) else held or memory.holds_input(rid)

    def _cancel_scope(self, rid: str) -> anyio.CancelScope:
        # Made and recorded before the task starts, so an Abort right behind the order
        # (handled before the task's first step) still cancels it.
        scope = self._scopes[rid] = anyio.CancelScope()
        return scope

    async def _guarded(self, rid: str, scope: anyio.CancelScope, job: Any, order: Any) -> None:
        with scope:
            try:
                # An Abort handled before the task started is seen here, even by a job that
                # would never yield (an allocation that fits at once).
                await anyio.lowlevel.checkpoint()
                await job(order)
            finally:
                if self._scopes.get(rid) is scope:
                    del self._scopes[rid]
                stopped = self._owed.pop(scope, None)
                if stopped is not None:
                    self._report(stopped)

    def _abort(self, rid: str, ack: int | None) -> None:
        assert self._memory is not None
        scope = self._scopes.pop(rid, None)
        if scope is not None:
            scope.cancel()
        if ack is not None:
            # The daemon holds this worker's slot until the run is over: a stage thread
            # goes on until its next step or the end of its pass, whatever the scope says.
            stopped = Stopped(request_id=rid, ack=ack)
            if scope is None:
                self._report(stopped)
            else:
                self._owed[scope] = stopped
        control = self._runs.pop(rid, None)
        if control is not None:
            control.stop()  # the stage's thread cannot be cancelled, only asked to stop
        self._memory.free(rid)

    def _report(self, msg: Any, buffers: list[Any] | None = None) -> None:
        """Queue ``msg`` for the daemon; one with tensor frames (a decoder's ``Done``) for the
        output connection."""
        (self._outputs if buffers else self._outbox).put(encode(msg), buffers or ())

    @staticmethod
    async def _send(outbox: ReportOutbox, sock: zmq.asyncio.Socket) -> None:
        """The one writer on ``sock`` once registered: everything ``outbox`` is given."""
        while True:
            for message in await outbox.take():
                await sock.send_multipart(message, copy=False)


async def run_worker(role: Role, cfg: Config, name: str | None = None, *,
                     early: list[signal.Signals] | None = None) -> None:
    """Run a worker until SIGTERM/SIGINT; exits cleanly, freeing its registration.
    ``early``: stop signals kept since the process started (``early_signals.keep``)."""
    async with anyio.create_task_group() as tg:
        async def stop_on_signal() -> None:
            with anyio.open_signal_receiver(*STOP_SIGNALS) as signals:
                for signum in early or ():  # as if they came now
                    log.info("worker.signal", signal=signum.name, during_start_up=True)
                    tg.cancel_scope.cancel()
                async for signum in signals:
                    log.info("worker.signal", signal=signal.Signals(signum).name)
                    runtime.say_stopping()
                    tg.cancel_scope.cancel()

        runtime = WorkerRuntime(role, cfg, name=name)
        tg.start_soon(stop_on_signal)
        await runtime.run()
        tg.cancel_scope.cancel()
