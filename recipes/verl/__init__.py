"""verl on Sluice: a recipe entrypoint for verl 0.9.1's PPO trainer with Sluice as its data plane.

- `config/sluice_ppo.yaml`: extends verl's `ppo_trainer` (Hydra) with verl's async knobs and
  the `sluice` checkpoint engine;
- `knobs`: maps those knobs onto Sluice's staleness control (`tq.StalenessConfig`);
- `checkpoint_engine`: `SluiceCheckpointEngine`, registered in verl's `CheckpointEngineRegistry`
  as `sluice`, carrying the trainer's weights through `weight_sync`;
- `main`: `python -m recipes.verl.main [overrides...]` runs verl's task runner.

Everything here uses Sluice's public API only (`transfer_queue`, `weight_sync`).
"""
