"""`python -m recipes.verl.main [hydra overrides...]`: verl 0.9.1's PPO trainer on Sluice.

Composes `config/sluice_ppo.yaml` (verl's `ppo_trainer` plus the async knobs and the `sluice`
checkpoint engine), writes the knobs into `transfer_queue.sluice` (`knobs.apply`), then runs
verl's own entry point (config validation, Ray, `TaskRunnerV1`), whose `tq.init(
config.transfer_queue)` starts Sluice as verl's data plane.
"""

from __future__ import annotations

import hydra
from verl.trainer import main_ppo

from recipes.verl import knobs


@hydra.main(config_path="config", config_name="sluice_ppo", version_base=None)
def main(config) -> None:
    """Map verl's async knobs onto Sluice, then run verl's task runner."""
    knobs.apply(config)
    main_ppo.main.__wrapped__(config)


if __name__ == "__main__":
    main()
