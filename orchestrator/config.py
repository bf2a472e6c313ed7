"""Configuration: frozen msgspec Structs that configs/*.toml decode into.

One file configures a whole cluster: the daemon reads ``[daemon]``, a worker reads
``[daemon]`` (to find it), ``[workers.<role>]``, ``[model]`` and ``[transfer]``, and every
process reads ``[log]``. Unknown
keys are errors that name the exact key, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Literal, TypeVar

import msgspec

from orchestrator.endpoints import WILDCARD_HOSTS, endpoint_problem, listens_beyond_this_host, same_address
from transfer.protocol import MAX_SLOTS, MAX_SUBMIT_BYTES, Label, Role
from transfer.specs import align_up

PositiveInt = Annotated[int, msgspec.Meta(gt=0)]
# Threads one worker starts: past a few hundred the process runs out of them (or memory for
# their stacks) as it starts, which is a setting's mistake, said as one.
Threads = Annotated[int, msgspec.Meta(ge=1, le=1024)]
# Finite (TOML reads `inf`): every wait has an end.
PositiveFloat = Annotated[float, msgspec.Meta(gt=0, le=1e9)]
# What ZMQ takes for a queue's length (a C int) and a frame's size (int64): past them the
# daemon's socket could not be set up (OverflowError), and the daemon hung in its stop.
SocketQueue = Annotated[int, msgspec.Meta(le=2**31 - 1)]
FrameBytes = Annotated[int, msgspec.Meta(le=2**63 - 1)]

DEV_TOKEN = "triptych-local-dev"
# A worker endpoint other hosts can reach needs a token they cannot guess: whoever
# registers can take requests, read their prompts and send back any image.
MIN_NETWORK_TOKEN_CHARS = 16


MiB = 1 << 20
DAY_S = 86400
DAY_MS = DAY_S * 1000


class Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Base of every config section."""


class DaemonConfig(Section):
    """The orchestrator: its three sockets, its queues, its deadlines."""

    client_endpoint: str = "tcp://127.0.0.1:5555"
    control_endpoint: str = "tcp://127.0.0.1:5556"
    # Workers DEALER-connect here to register, heartbeat and report.
    worker_endpoint: str = "tcp://127.0.0.1:5557"
    # Shared secret a worker must present to register. With a worker_endpoint other hosts
    # can reach it must be your own, of at least 16 characters (checked at load).
    token: Label = DEV_TOKEN  # the wire carries at most 512 characters (Register.token)
    dispatch: Literal["round_robin", "least_loaded", "power_of_two"] = "least_loaded"
    max_in_flight: PositiveInt = 8192  # admitted, unanswered requests; beyond it submits get ``overloaded``
    # Workers registered at once; a newcomer past it is refused (and retries). Each costs the
    # daemon a socket and two file descriptors, and ZMQ's sockets are counted per process.
    max_workers: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 256
    request_timeout_s: PositiveFloat = 600.0  # when Submit names none
    max_request_timeout_s: PositiveFloat = 3600.0
    # At least 0.1 s: the negotiator ticks every half heartbeat and takes a gap between ticks
    # longer than heartbeat_s for a stall of the daemon (a line each); below a loaded loop's
    # own jitter every tick would be one.
    heartbeat_s: Annotated[float, msgspec.Meta(ge=0.1, le=1e9)] = 1.0
    # Silence of misses * heartbeat_s evicts a worker. At least 3: silence of 2 beats only
    # makes it a suspect (actors/negotiator.py), and a live worker may be a beat late.
    heartbeat_misses: Annotated[int, msgspec.Meta(ge=3)] = 5
    drain_timeout_s: PositiveFloat = 30.0
    # A request whose worker was lost (dead, stuck, evicted) or whose hand-off failed (a write
    # that could not reach its receiver, a receiver without room in time) starts again from
    # its encoder on the workers left, this many times, within its own deadline. Stages are
    # deterministic, so a restart gives the same bytes; the cost is the work redone, and a
    # request that itself kills workers (or needs more room than any receiver has) takes
    # this many more attempts with it. 0 turns retries off.
    retries: Annotated[int, msgspec.Meta(ge=0, le=10)] = 1
    # Memory a silent (evicted, maybe still alive) sender was writing into stays reserved
    # this long, and a rejoining receiver waits this long; it must exceed the workers'
    # MC_TRANSFER_TIMEOUT (checked when the config loads, within this file, and against
    # each worker's own as it registers: workers go by the daemon's value).
    push_quarantine_s: PositiveFloat = 60.0
    # Each actor's mailbox holds the mail max_in_flight requests and one batch of worker
    # reports can post at once, plus this many more (orchestrator/daemon.py sizes them); a
    # full one is a sizing bug, and stops the daemon loudly (MailboxFull) rather than wait
    # or drop mail.
    mailbox_headroom: PositiveInt = 1024
    # Messages queued to one worker before it counts as stuck (ZMQ SNDHWM). At least 64: ZMQ
    # gives send credit back in batches of half of it, so with a few a worker reading its
    # orders can look full for a moment, and be evicted as stuck.
    worker_send_hwm: Annotated[SocketQueue, msgspec.Meta(ge=64)] = 1000
    # Replies ZMQ queues for one client connection (ZMQ_SNDHWM); what it cannot take yet is
    # held (client_held_bytes). Together they bound what a client connection that never
    # reads makes the daemon hold: this many of its replies, client_held_bytes, one more.
    client_send_hwm: Annotated[SocketQueue, msgspec.Meta(gt=0)] = 32
    # Beyond ZMQ's queue, replies one client connection has not taken yet are held by the
    # daemon; once this many bytes are held for it (the replies and the memory holding
    # them takes: actors/client_outbox.py), its next replies are dropped. A burst
    # of replies to a client that reads gets through whole, however large they are.
    client_held_bytes: PositiveInt = 64 * MiB
    # What the daemon holds for all client connections together (plus one reply): past it,
    # any reply that would wait is dropped, so many connections that never read cannot pin memory without
    # bound (clients are trusted, but a buggy one may open connections in a loop).
    client_held_total_bytes: PositiveInt = 1024 * MiB
    # A peer sending a larger frame is disconnected unread (ZMQ_MAXMSGSIZE). At least what
    # the largest valid Submit takes (MAX_SUBMIT_BYTES: two prompts of 16,384 characters):
    # below it a valid request is cut off and its client learns only that the connection
    # closed. A worker's frames carry the decoder's output (a video can be hundreds of MiB).
    client_max_message_bytes: Annotated[FrameBytes, msgspec.Meta(ge=MAX_SUBMIT_BYTES)] = 256 * 1024
    # At least what a Register takes (its slots and limits): below it every worker is cut off.
    worker_max_message_bytes: Annotated[FrameBytes, msgspec.Meta(ge=MiB)] = 1024 * MiB

    def __post_init__(self) -> None:
        keys = ("client_endpoint", "control_endpoint", "worker_endpoint")
        for key in keys:
            problem = endpoint_problem(getattr(self, key))
            if problem is not None:
                raise ValueError(f"daemon.{key} ({getattr(self, key)}) is {problem}")
        for i, key in enumerate(keys):
            for other in keys[i + 1:]:
                if same_address(getattr(self, key), getattr(self, other)):
                    raise ValueError(f"daemon.{key} ({getattr(self, key)}) and daemon.{other} "
                                     f"({getattr(self, other)}) are one address: each of the daemon's sockets needs "
                                     "an endpoint of its own")
        if self.client_held_bytes > self.client_held_total_bytes:
            raise ValueError(f"daemon.client_held_bytes ({self.client_held_bytes}) is more than "
                             f"daemon.client_held_total_bytes ({self.client_held_total_bytes}), which bounds all "
                             "client connections together: one connection could never hold it")
        if listens_beyond_this_host(self.worker_endpoint) and (
            self.token == DEV_TOKEN or self.token.lower().startswith("change-me")
            or len(self.token.strip()) < MIN_NETWORK_TOKEN_CHARS
        ):
            raise ValueError(
                f"daemon.worker_endpoint ({self.worker_endpoint}) can be reached from other hosts, so daemon.token "
                f"must be a secret of your own of at least {MIN_NETWORK_TOKEN_CHARS} characters, not a placeholder: "
                f"whoever registers as a worker gets requests and answers them")


class WorkerConfig(Section):
    """One role's worker processes."""

    # Requests a worker holds at once (running or staged); Register carries at most 1024.
    capacity: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 2
    # Stage runs at once in one worker (its threads share the device): more than 1 only for
    # a stage that leaves its device idle part of a run. Requests past it, up to capacity,
    # wait in the worker for a thread.
    compute_threads: Threads = 1
    torch_threads: Threads = 1
    pool_bytes: PositiveInt = 256 * MiB
    prealloc_slots: Annotated[int, msgspec.Meta(ge=0, le=MAX_SLOTS)] = 2
    prealloc_slot_bytes: PositiveInt = 16 * MiB
    alloc_timeout_s: PositiveFloat = 10.0
    # For requests whose client asked for progress: the least time between two Step reports.
    progress_interval_s: PositiveFloat = 0.5
    # The work socket's transport: "tcp" on bind_host/advertise_host, or "ipc" (a Unix socket
    # under the temp directory) when the daemon runs on the same host, which costs the
    # daemon's ZMQ I/O thread less per order.
    work_socket: Literal["tcp", "ipc"] = "tcp"
    bind_host: str = "127.0.0.1"
    # What the daemon dials: a real address, never a wildcard like 0.0.0.0.
    advertise_host: Annotated[str, msgspec.Meta(pattern=r"^\S+$")] = "127.0.0.1"
    connect_timeout_s: PositiveFloat = 60.0  # retrying the daemon until it is up
    # A decoder told to stop waits at most this long (heartbeating meanwhile) for the daemon
    # to take the outputs it has made: one still crossing a slow link when it exits would be
    # lost, and its request computed again elsewhere.
    stop_flush_s: PositiveFloat = 10.0
    # A stage run longer than this is hung (a wedged GPU, a deadlocked kernel): no thread can
    # be stopped from outside, so the worker logs worker.stage_hung, fails that run's request
    # (stage_failed: retried, it would hang the next worker), says Leaving and exits with
    # status 70 for its supervisor to start a fresh process; its other requests start again
    # elsewhere (daemon.retries). The default is the longest deadline a request can have: no
    # run past it can serve anyone.
    stage_timeout_s: PositiveFloat = 3600.0

    def __post_init__(self) -> None:
        if self.advertise_host in WILDCARD_HOSTS:
            raise ValueError(f"advertise_host ({self.advertise_host}) is a wildcard, which the daemon cannot dial: "
                             "give this host's address as the daemon reaches it")


# Each role's own defaults are those of its table's type, so that a table naming some keys
# still gets its role's defaults for the rest (not WorkerConfig's).


class EncoderWorkerConfig(WorkerConfig):
    capacity: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 4


class DecoderWorkerConfig(WorkerConfig):
    capacity: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 4
    prealloc_slots: Annotated[int, msgspec.Meta(ge=0, le=MAX_SLOTS)] = 4  # a receive slot per unit of capacity


class WorkersConfig(Section):
    encoder: EncoderWorkerConfig = EncoderWorkerConfig()
    denoiser: WorkerConfig = WorkerConfig()
    decoder: DecoderWorkerConfig = DecoderWorkerConfig()

    def for_role(self, role: Role) -> WorkerConfig:
        return getattr(self, role)


class NullStageConfig(Section):
    """Simulated stages: a fixed time and a deterministic output of a fixed size."""

    # At most a day: time.sleep refuses what it cannot count (inf, 1e300), failing every request.
    encoder_ms: Annotated[float, msgspec.Meta(ge=0, le=DAY_MS)] = 5.0
    denoiser_ms: Annotated[float, msgspec.Meta(ge=0, le=DAY_MS)] = 20.0
    decoder_ms: Annotated[float, msgspec.Meta(ge=0, le=DAY_MS)] = 5.0
    embed_shape: Annotated[tuple[PositiveInt, ...], msgspec.Meta(min_length=1)] = (1, 77, 64)
    # The null decoder shows three of the latent channels as an image's red, green and blue.
    latent_channels: Annotated[int, msgspec.Meta(ge=3)] = 4


class FaultsConfig(Section):
    """Failures the denoiser stages on request, for tests and fire drills (empty: none)."""

    fail_prompt: str = ""  # a prompt containing this makes the denoiser fail the request
    hang_prompt: str = ""  # ...makes the null denoiser hang, deaf to stops, as a wedged GPU would
    device_error_prompt: str = ""  # ...makes the null denoiser raise a CUDA error, as a faulting kernel would


class DiffusersConfig(Section):
    """A diffusers pipeline split across the three roles."""

    family: Literal["sd15", "pixart"] = "sd15"
    # A local diffusers-layout directory; empty builds the embedded tiny pipeline.
    path: str = ""
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    device: str = "cpu"  # "cuda", "cuda:1", ...
    # Seeds the tiny pipeline's random weights. TOML's 64-bit range: Python's TOML reader
    # takes larger integers, which torch.manual_seed refuses as each worker loads.
    seed: Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)] = 0


class LimitsConfig(Section):
    """The operator's caps on what one request may ask, below the model's own limits (0:
    the model's). Requests past them get ``invalid`` at the daemon's door."""

    max_size: Annotated[int, msgspec.Meta(ge=0)] = 0  # width and height
    max_steps: Annotated[int, msgspec.Meta(ge=0)] = 0
    max_images: Annotated[int, msgspec.Meta(ge=0)] = 0
    max_pixels: Annotated[int, msgspec.Meta(ge=0)] = 0  # width x height x frames x num_images


class ModelConfig(Section):
    kind: Literal["null", "diffusers"] = "null"
    null: NullStageConfig = NullStageConfig()
    diffusers: DiffusersConfig = DiffusersConfig()
    limits: LimitsConfig = LimitsConfig()
    faults: FaultsConfig = FaultsConfig()


# Loopback CI and laptops: TCP forced even if an RDMA device exists, sockets reused
# (the default opens one connection per transfer), fail fast, quiet logs.
LOCAL_MOONCAKE_ENV = {
    "MC_FORCE_TCP": "1",
    "MC_TCP_ENABLE_CONNECTION_POOL": "1",
    "MC_LOG_LEVEL": "WARNING",
    "MC_TRANSFER_TIMEOUT": "5",
}


MOONCAKE_DEFAULT_TIMEOUT_S = 30.0  # MC_TRANSFER_TIMEOUT when unset


def transfer_timeout_s(value: str | None) -> float:
    """An MC_TRANSFER_TIMEOUT value in seconds: how long a write is waited for before it is
    in doubt. Mooncake's default when unset or not a positive finite number (the config
    refuses those; from the shell, the longer wait is the safe one); a day at most, what a
    Register carries (the config refuses more; from the shell, cut to it)."""
    seconds = _seconds(value)
    return min(seconds, DAY_S) if 0 < seconds < math.inf else MOONCAKE_DEFAULT_TIMEOUT_S


def _is_seconds(value: str) -> bool:
    """Positive, and at most a day: a worker's Register carries it (write_timeout_s), bounded so."""
    return 0 < _seconds(value) <= DAY_S


def _seconds(value: str | None) -> float:
    """``value`` read as seconds; NaN if it is none or no number."""
    try:
        return float(value) if value else math.nan
    except ValueError:
        return math.nan


# protocol -> the variable that would force the other transport, that transport, the remedy.
_CONTRADICTING = {
    "tcp": ("MC_FORCE_HCA", "RDMA", "drop it"),
    "rdma": ("MC_FORCE_TCP", "TCP", 'drop it, and set MC_FORCE_HCA = "1" to fail rather than fall back to TCP'),
}


class TransferConfig(Section):
    """The data plane: Mooncake, and copies between workers of one host."""

    local_hostname: str = "127.0.0.1"
    metadata_server: str = "P2PHANDSHAKE"
    protocol: Literal["tcp", "rdma"] = "tcp"
    device_name: str = ""  # RNIC allow-list, e.g. "mlx5_0,mlx5_1"
    # Exported before the engine starts; Mooncake reads them from the environment.
    env: dict[str, str] = msgspec.field(default_factory=lambda: dict(LOCAL_MOONCAKE_ENV))
    # Workers on one host copy hand-offs into each other's shared pools (transfer/shm.py)
    # instead of going through Mooncake's loopback transport, about 7x slower.
    same_host_copy: bool = True

    def __post_init__(self) -> None:
        # os.environ refuses these as the worker starts its engine, after its model loaded.
        for name, value in self.env.items():
            if not name or "=" in name or "\0" in name:
                raise ValueError(f"transfer.env names {name!r}, which no environment variable can be called")
            if "\0" in value:
                raise ValueError(f"transfer.env.{name} holds a NUL character, which no environment variable can")
        # Mooncake picks its transport from the machine and these variables, never from
        # `protocol`: one they contradict would silently run over the other.
        forced, other, fix = _CONTRADICTING[self.protocol]
        if forced in self.env:  # Mooncake asks only whether it is set: "0" forces too
            raise ValueError(f"transfer.protocol is {self.protocol!r}, but transfer.env.{forced} forces {other} "
                             f"(Mooncake goes by the environment): {fix}")

    @property
    def local_host(self) -> str:
        """``local_hostname`` without a port: Mooncake takes "host" or "host:port", and with
        the P2P handshake picks its port itself (a bare IPv6 address is left whole)."""
        host = self.local_hostname
        return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class LogConfig(Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    json: bool | None = None  # None: JSON unless stderr is a terminal


class Config(Section):
    daemon: DaemonConfig = DaemonConfig()
    workers: WorkersConfig = WorkersConfig()
    model: ModelConfig = ModelConfig()
    transfer: TransferConfig = TransferConfig()
    log: LogConfig = LogConfig()

    def __post_init__(self) -> None:
        # Memory a write may still be landing in is handed out again after push_quarantine_s
        # (by the daemon for a silent sender, by a rejoining receiver for itself): only a
        # quarantine longer than any write can last keeps that memory from being corrupted.
        given = self.transfer.env.get("MC_TRANSFER_TIMEOUT")
        if given is not None and not _is_seconds(given):
            raise ValueError(f"transfer.env.MC_TRANSFER_TIMEOUT ({given!r}) must be a positive number of seconds, "
                             f"at most {DAY_S} (a day)")
        timeout_s = transfer_timeout_s(given)
        if self.daemon.push_quarantine_s <= timeout_s:
            raise ValueError(f"daemon.push_quarantine_s ({self.daemon.push_quarantine_s:g}) must exceed the "
                             f"Mooncake transfer timeout ({timeout_s:g} s, transfer.env.MC_TRANSFER_TIMEOUT)")
        # Receivers carve their preallocated slots from the pool; what is left is where
        # outputs are staged and slow-path inputs allocated, so some must be left.
        for role in ("denoiser", "decoder"):
            w = self.workers.for_role(role)
            slots = w.prealloc_slots * align_up(w.prealloc_slot_bytes)
            if w.pool_bytes <= slots:
                raise ValueError(f"workers.{role}.pool_bytes ({w.pool_bytes}) must exceed its preallocated slots "
                                 f"({w.prealloc_slots} x {w.prealloc_slot_bytes} bytes, aligned: {slots})")


T = TypeVar("T")


def load_config(path: str | Path) -> Config:
    return read_config(path, Config)


def read_config(path: str | Path, kind: type[T]) -> T:
    """Decode a TOML file as ``kind``; errors name the file and the offending key (``- at `$.daemon.token```)."""
    try:
        return msgspec.toml.decode(Path(path).read_bytes(), type=kind)
    except OSError as exc:
        raise OSError(f"cannot read the config file {path}: {exc.strerror or exc}") from None
    except msgspec.ValidationError as exc:
        raise msgspec.ValidationError(f"{path}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise msgspec.DecodeError(f"{path}: {exc}") from None
