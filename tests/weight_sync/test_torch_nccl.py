"""The torch transport's memories: gloo stages and receives in host memory; NCCL (marked `cuda`,
two GPUs) broadcasts straight from GPU staging into GPU receive buffers, versions exact."""

from __future__ import annotations

import pytest
import torch

from weight_sync import TorchTransport, WeightPublisher

from .harness import CTX
from .workers import BUCKET, nccl_subscriber, weights


def test_gloo_stays_in_host_memory():
    transport = TorchTransport()
    assert transport.staging == "host" and transport.receive_device is None and transport.deltas


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs: it refuses two processes on one GPU")
def test_nccl_broadcasts_from_gpu_staging_into_gpu_buffers():
    transport = TorchTransport(world_size=2, backend="nccl")
    assert transport.staging == "cuda" and transport.receive_device == torch.device("cuda", 0)
    assert not transport.deltas  # frames are built and applied on the host: NCCL versions go whole
    out = CTX.Queue()
    with WeightPublisher(None, transport=transport, bucket_bytes=BUCKET) as pub:
        proc = CTX.Process(target=nccl_subscriber, args=(out, 1, pub.endpoint, 3), daemon=True)
        proc.start()
        for version in (1, 2, 3):
            pub.publish({n: t.cuda() for n, t in weights(version).items()}, version)
            assert pub._table.find(version).mapped.tensor.is_cuda  # staged on the GPU, no host bounce
        assert out.get(timeout=120) == ("exact", 1, [True, True, True])
        proc.join(30)
