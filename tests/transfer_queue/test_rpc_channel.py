"""The kernel's asyncio channel (`transfer_queue.rpc.AsyncChannel`) against a real peer socket."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from transfer_queue._messages import Reply, StorageRequest
from transfer_queue.rpc import AsyncChannel, Codec, Ping


async def test_posted_requests_are_queued_not_dropped_when_the_peer_lags():
    """More posts than the socket's queue holds, to a peer that reads nothing yet: every one
    arrives, in order, once it reads (a dropped `Free` would leak a unit's bytes, a dropped
    `Ping` make a busy unit look dead)."""
    peer = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
    peer.setsockopt(zmq.LINGER, 0)
    port = peer.bind_to_random_port("tcp://127.0.0.1")
    channel = AsyncChannel(f"tcp://127.0.0.1:{port}", Codec(Reply))
    try:
        n = 3 * channel.sock.getsockopt(zmq.SNDHWM)  # well past what the socket queues
        for _ in range(n):
            channel.post(Ping())
        requests = Codec(StorageRequest)
        ids = []
        while len(ids) < n:
            frames = await asyncio.wait_for(peer.recv_multipart(), 30)
            rid, msg, _ = requests.decode(frames[1:])
            if isinstance(msg, Ping):
                ids.append(rid)
        assert ids == sorted(ids) and len(set(ids)) == n
    finally:
        channel.close()
        peer.close()
