"""The whole daemon in this process, sent messages nested past the interpreter's recursion
limit: msgspec raises RecursionError even inside a field it skips. Each socket answers or
drops it like any bad message, and the daemon keeps serving.

The limit differs between interpreters (measured: 3.11 stops near 1,000 levels, 3.13 near
10,000, and 3.12.3 decoded 2,000), so the nesting is 60,000 deep: past all of them, and at
60 KB still under the smallest socket's size limit (the control socket's 64 KiB)."""

from __future__ import annotations

from pathlib import Path

import anyio
import msgspec
import zmq
import zmq.asyncio

from orchestrator.config import load_config
from orchestrator.control_client import Control
from orchestrator.daemon import serve
from transfer.protocol import CLIENT_REPLY, CONTROL_REPLY, Reason, Rejected

ROOT = Path(__file__).resolve().parents[2]
DEPTH = 60_000


def nested(message: dict) -> bytes:
    """``message`` with one more field, an unknown one: a list inside a list, DEPTH deep."""
    body = msgspec.msgpack.encode(message)
    assert 0x80 <= body[0] < 0x8F  # a fixmap: one more entry is one more in its count
    return bytes([body[0] + 1]) + body[1:] + msgspec.msgpack.encode("deep") + b"\x91" * DEPTH + b"\xc0"


async def test_a_message_nested_too_deep_is_refused_on_every_socket(
    ctx: zmq.asyncio.Context, tmp_path: Path, logs: list[dict]
) -> None:
    cfg = load_config(ROOT / "configs" / "test.toml")
    daemon = msgspec.structs.replace(cfg.daemon, client_endpoint=f"ipc://{tmp_path}/client",
                                     control_endpoint=f"ipc://{tmp_path}/control",
                                     worker_endpoint=f"ipc://{tmp_path}/workers")
    cfg = msgspec.structs.replace(cfg, daemon=daemon)
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            endpoints = await tg.start(serve, cfg)
            with ctx.socket(zmq.DEALER) as worker, ctx.socket(zmq.DEALER) as client, ctx.socket(zmq.REQ) as control:
                worker.connect(endpoints["worker"])
                await worker.send(nested({"kind": "Heartbeat"}))  # dropped: nobody to answer
                client.connect(endpoints["client"])
                await client.send_multipart([b"", nested({"kind": "Submit", "protocol": 1, "params": {"prompt": "x"}})])
                _, reply = await client.recv_multipart()
                refused = CLIENT_REPLY.decode(reply)
                assert isinstance(refused, Rejected) and refused.reason == Reason.INVALID
                assert "recursion" in refused.message
                control.connect(endpoints["control"])
                await control.send(nested({"kind": "GetStats"}))
                refused = CONTROL_REPLY.decode(await control.recv())
                assert isinstance(refused, Rejected) and refused.reason == Reason.INVALID
            stats = await anyio.to_thread.run_sync(Control(endpoints["control"]).stats)
            assert stats.draining is False  # still serving, after all three
            tg.cancel_scope.cancel()
    # Not a message test, but this daemon's log is at hand: the token never reaches it.
    (settings,) = [entry for entry in logs if entry["event"] == "daemon.config"]
    assert settings["daemon"]["token"] == "<redacted>" and daemon.token not in repr(logs)
