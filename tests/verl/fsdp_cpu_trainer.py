"""A verl trainer process on CPU: a real `FSDPEngineWithLMHead` (FSDP2 over gloo, sdpa attention)
whose weights `SluiceCheckpointEngine` publishes as versions 1 and 2 (every parameter + 1).

verl has no CPU platform, so `PlatformCPU` below (a `PlatformCUDA` with device "cpu", gloo and
no-op device calls) is installed before verl asks for one. Run by `test_recipe.py` as
`python tests/verl/fsdp_cpu_trainer.py MODEL_DIR`; it attaches to the Sluice cluster of
`SLUICE_TQ_ADDRESS`, publishes version 2 once the test announces `recipes.verl.test/got-1` (a
subscriber applies the newest version, so it would otherwise skip 1) and exits once it
announces `recipes.verl.test/done`.
"""

from __future__ import annotations

import asyncio
import os
import sys

import torch
from verl.plugin.platform import platform_manager
from verl.plugin.platform.platform_cuda import PlatformCUDA


class PlatformCPU(PlatformCUDA):
    """verl's CUDA platform, pointed at the CPU."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def device_module(self):
        return torch.cpu

    def is_available(self) -> bool:
        return True

    def current_device(self):
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index) -> None:
        pass

    def synchronize(self, device_index=None) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def communication_backend_name(self) -> str:
        return "gloo"

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass


def main(model_dir: str) -> None:
    platform_manager.set_platform(PlatformCPU())
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=os.environ.get("MASTER_PORT", "29533"),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
    )
    torch.distributed.init_process_group("gloo")
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    import transfer_queue as tq
    from recipes.verl.checkpoint_engine import SluiceCheckpointEngine

    engine = FSDPEngineWithLMHead(
        model_config=HFModelConfig(
            path=model_dir, load_tokenizer=False, override_config={"attn_implementation": "sdpa"}
        ),
        engine_config=FSDPEngineConfig(strategy="fsdp2", fsdp_size=1),
        optimizer_config=FSDPOptimizerConfig(lr=1e-3),
        checkpoint_config=CheckpointConfig(),
    )
    engine.initialize()
    sender = SluiceCheckpointEngine(bucket_size=1 << 20, is_master=True, transport="tcp")
    try:
        for step in (1, 2):
            if step == 2:
                with tq.connect(sender.address) as client:  # the test has taken version 1
                    client.lookup("recipes.verl.test/got-1", timeout=120.0)
                with torch.no_grad():
                    for param in engine.module.parameters():
                        param.add_(1.0)
            weights, _ = engine.get_per_tensor_param()
            asyncio.run(sender.send_weights(weights, global_steps=step))
        with tq.connect(sender.address) as client:
            client.lookup("recipes.verl.test/done", timeout=120.0)
    finally:
        sender.close()
        tq.close()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
