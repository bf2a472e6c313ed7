"""Config: the shipped TOML files load, and every mistake names its exact key."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from orchestrator.config import Config, load_config
from orchestrator.endpoints import dial_problem

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cfg.toml"
    path.write_text(text)
    return path


def test_local_config_loads() -> None:
    cfg = load_config(CONFIGS / "local.toml")
    assert cfg.model.kind == "diffusers"
    assert cfg.daemon.dispatch == "least_loaded"
    assert cfg.workers.denoiser.prealloc_slot_bytes == 1 << 20


def test_test_config_loads() -> None:
    cfg = load_config(CONFIGS / "test.toml")
    assert cfg.daemon.token == "triptych-test"
    assert cfg.model.kind == "null"
    assert cfg.model.null.embed_shape == (1, 77, 64)
    assert cfg.model.faults.fail_prompt == "please fail"


def test_bench_config_loads() -> None:
    cfg = load_config(CONFIGS / "bench.toml")
    assert cfg.model.kind == "null" and cfg.model.null.denoiser_ms == 0


def test_the_production_sketch_loads_once_its_token_is_set(tmp_path: Path) -> None:
    """Its placeholder token is refused (other hosts reach its worker_endpoint); with a real
    secret every other setting it ships is valid."""
    sketch = (CONFIGS / "example.prod.toml").read_text()
    with pytest.raises(ValueError, match="daemon.token"):
        load_config(CONFIGS / "example.prod.toml")
    cfg = load_config(write(tmp_path, sketch.replace("CHANGE-ME-to-a-long-random-secret", "s3cret-of-our-own-1234")))
    assert cfg.transfer.protocol == "rdma" and cfg.model.diffusers.path == "/models/stable-diffusion-v1-5"


def test_empty_file_gives_the_defaults(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "")) == Config()


def test_for_role_returns_that_roles_section() -> None:
    cfg = load_config(CONFIGS / "test.toml")
    assert cfg.workers.for_role("denoiser") is cfg.workers.denoiser


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("[daemon]\nworkerz = 1\n", "unknown field `workerz` - at `$.daemon`"),
        ("[workerz]\n", "unknown field `workerz`"),  # at the root, msgspec names no path
        ("[model.null]\nencoder_mss = 1.0\n", "unknown field `encoder_mss` - at `$.model.null`"),
    ],
)
def test_unknown_key_names_its_path(tmp_path: Path, text: str, where: str) -> None:
    with pytest.raises(msgspec.ValidationError) as info:
        load_config(write(tmp_path, text))
    assert where in str(info.value)


@pytest.mark.parametrize(
    ("text", "path"),
    [
        ("[workers.denoiser]\ncapacity = 0\n", "$.workers.denoiser.capacity"),
        ("[workers.denoiser]\ncapacity = 2000\n", "$.workers.denoiser.capacity"),  # Register carries at most 1024
        ('[daemon]\ndispatch = "fastest"\n', "$.daemon.dispatch"),
        ("[daemon]\nheartbeat_s = -1.0\n", "$.daemon.heartbeat_s"),
        ("[model.null]\nencoder_ms = -1.0\n", "$.model.null.encoder_ms"),
        ('[daemon]\nmax_in_flight = "lots"\n', "$.daemon.max_in_flight"),
        ('[log]\nlevel = "loud"\n', "$.log.level"),
        ("[daemon]\nheartbeat_misses = 2\n", "$.daemon.heartbeat_misses"),
        ("[daemon]\nheartbeat_s = inf\n", "$.daemon.heartbeat_s"),  # a dead worker would never be evicted
        ("[workers.denoiser]\nalloc_timeout_s = inf\n", "$.workers.denoiser.alloc_timeout_s"),
        ("[model.null]\nembed_shape = [-1, 77]\n", "$.model.null.embed_shape[0]"),
        ("[model.null]\nembed_shape = []\n", "$.model.null.embed_shape"),
        ("[model.null]\nlatent_channels = 2\n", "$.model.null.latent_channels"),  # the decoder shows three
        ("[daemon]\nworker_max_message_bytes = 64\n", "$.daemon.worker_max_message_bytes"),  # no Register fits
        ("[daemon]\nclient_max_message_bytes = 1024\n", "$.daemon.client_max_message_bytes"),  # a long prompt: cut off
        # Send credit comes back in batches: a worker reading its orders would look stuck.
        ("[daemon]\nworker_send_hwm = 1\n", "$.daemon.worker_send_hwm"),
        ("[daemon]\nheartbeat_s = 0.001\n", "$.daemon.heartbeat_s"),  # every tick would read as a stall
        # Past TOML's 64-bit integers (which Python's TOML reader still takes) torch cannot seed.
        ("[model.diffusers]\nseed = 18446744073709551616\n", "$.model.diffusers.seed"),
        # Past what ZMQ takes: the daemon's socket could not be set up, and its stop hung.
        ("[daemon]\nworker_send_hwm = 2147483648\n", "$.daemon.worker_send_hwm"),
        ("[daemon]\nclient_send_hwm = 2147483648\n", "$.daemon.client_send_hwm"),
        ("[daemon]\nworker_max_message_bytes = 9223372036854775808\n", "$.daemon.worker_max_message_bytes"),
        # Longer than a Register carries: every worker was refused as it registered.
        (f'[daemon]\ntoken = "{"t" * 513}"\n', "$.daemon.token"),
        ("[model.null]\ndenoiser_ms = inf\n", "$.model.null.denoiser_ms"),  # every request failed in time.sleep
    ],
)
def test_bad_value_names_its_path(tmp_path: Path, text: str, path: str) -> None:
    with pytest.raises(msgspec.ValidationError, match=f"- at `{re.escape(path)}`$"):
        load_config(write(tmp_path, text))


def test_malformed_toml_is_a_decode_error(tmp_path: Path) -> None:
    with pytest.raises(msgspec.DecodeError):
        load_config(write(tmp_path, "[daemon\n"))


def test_a_config_file_that_cannot_be_read_is_said_to_be_the_config(tmp_path: Path) -> None:
    """A bare "[Errno 2] No such file or directory: 'x.toml'" did not say which file it was."""
    with pytest.raises(OSError, match=f"^cannot read the config file {tmp_path}/absent.toml: No such file"):
        load_config(tmp_path / "absent.toml")


@pytest.mark.parametrize(("text", "says"), [
    ('[daemon]\nclient_endpoint = "ipc:///tmp/t"\ncontrol_endpoint = "ipc:///tmp/t"\n',
     "daemon.client_endpoint (ipc:///tmp/t) and daemon.control_endpoint (ipc:///tmp/t) are one address: each of "
     "the daemon's sockets needs an endpoint of its own"),
    # Spelt apart, one address: the second bind failed, hinting at "a daemon already running?".
    ('[daemon]\nclient_endpoint = "tcp://127.0.0.1:5555"\ncontrol_endpoint = "tcp://localhost:5555"\n',
     "daemon.client_endpoint (tcp://127.0.0.1:5555) and daemon.control_endpoint (tcp://localhost:5555) are one "
     "address"),
    ('[daemon]\nclient_endpoint = "tcp://0.0.0.0:5555"\nworker_endpoint = "tcp://127.0.0.1:5555"\n',
     "daemon.client_endpoint (tcp://0.0.0.0:5555) and daemon.worker_endpoint (tcp://127.0.0.1:5555) are one "
     "address"),
    ("[daemon]\nclient_held_bytes = 2048\nclient_held_total_bytes = 1024\n",
     "daemon.client_held_bytes (2048) is more than daemon.client_held_total_bytes (1024)"),
], ids=["one endpoint for two sockets", "one endpoint in two spellings", "a wildcard over another",
        "a connection's share past the total"])
def test_contradictory_daemon_settings_are_refused(tmp_path: Path, text: str, says: str) -> None:
    with pytest.raises(msgspec.ValidationError, match=re.escape(says)):
        load_config(write(tmp_path, text))


@pytest.mark.parametrize(("endpoint", "problem"), [
    ("tcp://10.0.0.5:5557", None),
    ("ipc:///run/triptych/workers", None),
    ("tcp://*:5557", "an address for the daemon to bind, not one to connect to"),
    ("tcp://0.0.0.0:5557", None),  # Linux connects it to this host
    ("tcp://daemon-host:*", "an address for the daemon to bind, not one to connect to"),
    ("tcp://daemon-host:99999", "port 99999, not 1-65535"),
    ("ipc://*", "an address for the daemon to bind (a path of ZMQ's choosing), not one to connect to"),
    ("tcp://daemon-host:\u0665\u0665\u0665\u0665", "not tcp://host:port"),  # Arabic-Indic digits, which int() reads
    ("ipc:///tmp/" + "p" * 102, None),  # 107 bytes: the most it takes
    ("ipc:///tmp/" + "p" * 103, "an ipc path of 108 bytes, past the 107 a Unix socket's address holds"),
])
def test_what_a_peer_can_connect_to(endpoint: str, problem: str | None) -> None:
    """The daemon may bind a wildcard (its config loads); a worker or a command must dial a real address."""
    found = dial_problem(endpoint)
    assert found is None if problem is None else found.startswith(problem)


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "*", "::"])
def test_a_wildcard_advertise_host_is_refused(tmp_path: Path, wildcard: str) -> None:
    """The daemon dials what a worker advertises, so a wildcard would never reach it."""
    path = tmp_path / "c.toml"
    path.write_text(f'[workers.denoiser]\nadvertise_host = "{wildcard}"\n')
    with pytest.raises(msgspec.ValidationError, match=r"advertise_host \(.+\) is a wildcard, which the daemon "
                                                      r"cannot dial.* - at `\$\.workers\.denoiser`$"):
        load_config(path)


@pytest.mark.parametrize("key", ["client_endpoint", "control_endpoint", "worker_endpoint"])
@pytest.mark.parametrize("endpoint", ["htp://127.0.0.1:5556", "tcp://127.0.0.1", "tcp://h:port", "ipc://", "5555",
                                      "tcp://::1:5555"])
def test_an_endpoint_that_cannot_be_bound_is_refused_at_load_naming_its_key(
    tmp_path: Path, key: str, endpoint: str
) -> None:
    """Before, the daemon started and failed at its bind, with ZMQ's words and no key."""
    with pytest.raises(msgspec.ValidationError,
                       match=rf"daemon\.{key} \({endpoint}\) is not tcp://host:port or ipc://path"):
        load_config(write(tmp_path, f'[daemon]\n{key} = "{endpoint}"\n'))


@pytest.mark.parametrize("port", ["0", "65536", "99999"])
def test_a_port_zmq_would_swap_for_a_random_one_is_refused_at_load(tmp_path: Path, port: str) -> None:
    """ZMQ binds port 0, or one past 65535, to a random port: the daemon came up where no
    worker or client would look."""
    with pytest.raises(msgspec.ValidationError,
                       match=rf"daemon\.client_endpoint \(tcp://127\.0\.0\.1:{port}\) is port {port}, not 1-65535"):
        load_config(write(tmp_path, f'[daemon]\nclient_endpoint = "tcp://127.0.0.1:{port}"\n'))
    for fine in ("1", "65535", "*"):
        assert load_config(write(tmp_path, f'[daemon]\nclient_endpoint = "tcp://127.0.0.1:{fine}"\n'))


@pytest.mark.parametrize(("section", "refused"), [
    ('[daemon]\npush_quarantine_s = 5.0\n', True),  # the default MC_TRANSFER_TIMEOUT is 5
    ('[daemon]\npush_quarantine_s = 6.0\n', False),
    ('[daemon]\npush_quarantine_s = 20.0\n[transfer]\nenv = {}\n', True),  # unset: Mooncake's 30 s
])
def test_the_push_quarantine_must_outlast_a_transfer(tmp_path: Path, section: str, refused: bool) -> None:
    path = tmp_path / "c.toml"
    path.write_text(section)
    if refused:
        with pytest.raises(msgspec.ValidationError, match="push_quarantine_s .* must exceed"):
            load_config(path)
    else:
        assert load_config(path).daemon.push_quarantine_s == 6.0


@pytest.mark.parametrize("value", ["-5", "0", "nan", "inf", "soon", "86401"])
def test_a_transfer_timeout_that_is_no_wait_is_refused(tmp_path: Path, value: str) -> None:
    """Negative, it made every write in doubt at once; NaN, a write to a hung peer was polled
    for ever; past a day, no Register could carry it (every worker was refused)."""
    with pytest.raises(msgspec.ValidationError, match=r"transfer\.env\.MC_TRANSFER_TIMEOUT .* must be a positive "
                                                      r"number of seconds, at most 86400"):
        load_config(write(tmp_path, f'[transfer.env]\nMC_TRANSFER_TIMEOUT = "{value}"\n'))


@pytest.mark.parametrize(("text", "says"), [
    ('[transfer]\nprotocol = "rdma"\n', "transfer.protocol is 'rdma', but transfer.env.MC_FORCE_TCP forces TCP"),
    ('[transfer.env]\nMC_FORCE_HCA = "1"\n', "transfer.protocol is 'tcp', but transfer.env.MC_FORCE_HCA forces RDMA"),
    # Mooncake asks only whether the variable is set.
    ('[transfer]\nprotocol = "rdma"\n[transfer.env]\nMC_FORCE_TCP = "0"\n',
     "transfer.protocol is 'rdma', but transfer.env.MC_FORCE_TCP forces TCP"),
])
def test_a_protocol_the_environment_overrides_is_refused(tmp_path: Path, text: str, says: str) -> None:
    """Mooncake picks its transport from the environment, not from `protocol`: an "rdma"
    config with the default MC_FORCE_TCP ran over TCP, saying nothing (a config audit)."""
    with pytest.raises(msgspec.ValidationError, match=re.escape(says)):
        load_config(write(tmp_path, text))


@pytest.mark.parametrize(("entry", "says"), [
    ('"A=B" = "1"', "transfer.env names 'A=B', which no environment variable can be called"),
    ('"" = "1"', "transfer.env names '', which no environment variable can be called"),
    ('MC_LOG_LEVEL = "WARN\\u0000"', "transfer.env.MC_LOG_LEVEL holds a NUL character"),
])
def test_an_environment_entry_no_process_can_have_is_refused_at_load(tmp_path: Path, entry: str,
                                                                     says: str) -> None:
    """os.environ refused it as each worker started its engine, after its model had loaded: a
    traceback per worker."""
    with pytest.raises(msgspec.ValidationError, match=re.escape(says)):
        load_config(write(tmp_path, f"[transfer.env]\n{entry}\n"))


@pytest.mark.parametrize("pool_bytes", [1 << 20, 2 << 20])
def test_a_receiver_pool_must_hold_more_than_its_preallocated_slots(tmp_path: Path, pool_bytes: int) -> None:
    """Smaller, the worker fails at start; equal, it registers and every request fails."""
    text = f"[workers.decoder]\npool_bytes = {pool_bytes}\nprealloc_slots = 2\nprealloc_slot_bytes = {1 << 20}\n"
    with pytest.raises(msgspec.ValidationError, match="workers.decoder.pool_bytes"):
        load_config(write(tmp_path, text))
    load_config(write(tmp_path, text.replace(f"pool_bytes = {pool_bytes}", f"pool_bytes = {3 << 20}")))


def test_preallocated_slots_are_at_most_what_the_daemon_takes(tmp_path: Path) -> None:
    """More would be refused at registration (the daemon sorts and checks every slot on its loop)."""
    text = "[workers.decoder]\nprealloc_slots = {n}\nprealloc_slot_bytes = 256\npool_bytes = 4194304\n"
    with pytest.raises(msgspec.ValidationError, match=r"<= 4096 - at `\$\.workers\.decoder\.prealloc_slots`"):
        load_config(write(tmp_path, text.format(n=4097)))
    assert load_config(write(tmp_path, text.format(n=4096))).workers.decoder.prealloc_slots == 4096


@pytest.mark.parametrize(("endpoint", "token", "refused"), [
    ("tcp://0.0.0.0:5557", "triptych-local-dev", True),  # the built-in token, on every interface
    ("tcp://10.0.0.2:5557", "CHANGE-ME-to-a-long-random-secret", True),  # the example's placeholder
    ("tcp://*:5557", "short-secret", True),
    ("tcp://eth0:5557", " " * 20, True),
    ("tcp://0.0.0.0:5557", "change-me-0123456789", True),
    ("tcp://127.0.0.1:5557", "triptych-local-dev", False),  # loopback: this host only
    ("tcp://localhost:5557", "x", False),
    ("ipc:///tmp/triptych-workers", "x", False),
])
def test_a_worker_endpoint_other_hosts_reach_needs_a_real_token(
        tmp_path: Path, endpoint: str, token: str, refused: bool) -> None:
    text = f'[daemon]\nworker_endpoint = "{endpoint}"\ntoken = "{token}"\n'
    if refused:
        with pytest.raises(msgspec.ValidationError, match="daemon.token must be a secret of your own"):
            load_config(write(tmp_path, text))
    else:
        assert load_config(write(tmp_path, text)).daemon.token == token


def test_a_role_table_naming_some_keys_keeps_the_roles_defaults_for_the_rest(tmp_path: Path) -> None:
    """Before, writing [workers.decoder] at all gave it WorkerConfig's capacity and slots (2),
    not the decoder's (4), halving it against configuration.md."""
    written = load_config(write(tmp_path, "[workers.encoder]\ncompute_threads = 1\n"
                                          "[workers.denoiser]\ncompute_threads = 1\n"
                                          "[workers.decoder]\ncompute_threads = 1\n")).workers
    default = Config().workers
    for role in ("encoder", "denoiser", "decoder"):
        assert written.for_role(role) == default.for_role(role)
    assert (default.encoder.capacity, default.denoiser.capacity, default.decoder.capacity) == (4, 2, 4)
    assert default.decoder.prealloc_slots == 4


def test_an_ipv6_endpoint_is_refused_at_load_saying_why(tmp_path: Path) -> None:
    with pytest.raises(msgspec.ValidationError, match=r"daemon\.client_endpoint \(tcp://\[::1\]:5555\) is an IPv6 "
                                                      r"endpoint, which Triptych's sockets do not enable"):
        load_config(write(tmp_path, '[daemon]\nclient_endpoint = "tcp://[::1]:5555"\n'))


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:6000", "tcp://*:5556", "tcp://*:*", "tcp://eth0:5555",
                                      "tcp://gpu-host-3.example:7000", "ipc:///tmp/triptych/c", "ipc://@abstract"])
def test_the_endpoints_operators_write_load(tmp_path: Path, endpoint: str) -> None:
    assert (load_config(write(tmp_path, f'[daemon]\ncontrol_endpoint = "{endpoint}"\n')).daemon.control_endpoint
            == endpoint)
