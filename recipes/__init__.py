"""What users run on top of Sluice's public API (`transfer_queue`, `weight_sync`), nothing else.

Async GRPO, rollout and training as separate processes around one cluster: `rollout_worker` and
`async_trainer` (`python -m recipes.<name> --address A ...`), `experiments` to compare configs
(`configs/*.yaml`), `demo` (`make demo`), `colocated` (the one-process baseline), and `verl/`,
verl's trainer on Sluice. One line per module: docs/architecture.md, "The module map"; how to run
them: docs/recipes.md.
"""
