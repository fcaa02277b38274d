"""Test peers of Sluice services, over the RPC kernel (`transfer_queue.wire.rpc`).

`peer(address)` is a `Channel` to any service (its replies are left unchecked by `reply`,
raised as `tq.*` errors by `call`). `raw(channel, frames)` is the one way a fuzz test puts bytes
that are not a well-formed Sluice message on the wire; it returns the service's decoded answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transfer_queue.wire.messages import Reply
from transfer_queue.wire.rpc import Channel, Codec

__all__ = ["peer", "raw", "ask"]


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
