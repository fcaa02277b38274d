"""Test peers of Sluice services, over the RPC kernel (`transfer_queue.wire.rpc`).

`peer(address)` is a `Channel` to any service (its replies are left unchecked by `reply`,
raised as `tq.*` errors by `call`). `raw(channel, frames)` is the one way a fuzz test puts bytes
that are not a well-formed Sluice message on the wire; it returns the service's decoded answer.
`ParkedService` is a service whose reads park until a test releases them, for the channels'
tests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from transfer_queue.wire.errors import SchemaError
from transfer_queue.wire.messages import CommitWrite, Free, Read, Reply, StorageRequest, UnitStatus
from transfer_queue.wire.rpc import Channel, Codec, Ok, Service, current_peer

__all__ = ["peer", "raw", "ask", "ParkedService"]


def peer(address: str) -> Channel:
    """A channel to the service at `address` (close it when done)."""
    return Channel(address, Codec(Reply), name=f"the service at {address}")


def ask(channel: Channel, msg: Any, data: Sequence[Any] = (), timeout: float = 10.0) -> Any:
    """The service's reply to `msg`, an `ErrorReply` included (not raised)."""
    return channel.reply(channel.send(msg, data), timeout)[0]


def raw(channel: Channel, frames: Sequence[Any], timeout: float = 5.0) -> tuple[int, Any, list[Any]]:
    """Send `frames` as they are and return the next answer, decoded: (request id, message, data)."""
    channel.sock.send_multipart(list(frames))
    assert channel.sock.poll(int(timeout * 1000)), "the service did not answer"
    return channel.codec.decode(channel.sock.recv_multipart(copy=False))


class ParkedService(Service):
    """A service (with a local lane if `local`): `Read` parks until released (its peer noted),
    `Free` is a notice refused for an empty partition, `UnitStatus` echoes its data frames,
    `CommitWrite` answers with its token's bytes in a buffer the next `CommitWrite` reuses."""

    def __init__(self, max_frame_bytes: int = -1, local: bool = False):
        super().__init__(Codec(StorageRequest), "tcp://127.0.0.1:*", max_frame_bytes, local=local)
        self.parked: list[asyncio.Future] = []
        self.parkers: list[bytes] = []
        self.cancelled = 0
        self.gone: list[bytes] = []
        self.on_peer_gone = self.gone.append
        self.route(Read, self._read)
        self.route(Free, self._free)
        self.route(UnitStatus, lambda msg, data: (Ok(), data))
        self.scratch = bytearray(16)
        self.route(CommitWrite, self._scratch)

    async def _read(self, msg: Read, data: list[Any]) -> Ok:
        fut = asyncio.get_running_loop().create_future()
        self.parked.append(fut)
        self.parkers.append(current_peer.get())
        try:
            await fut
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return Ok()

    def _free(self, msg: Free, data: list[Any]) -> None:
        if not msg.partition:
            raise SchemaError("no partition")

    def _scratch(self, msg: CommitWrite, data: list[Any]) -> tuple[Ok, list[Any]]:
        self.scratch[:] = msg.token.to_bytes(16, "little")
        return Ok(), [memoryview(self.scratch)]
