"""What users run on top of Sluice's public API (`transfer_queue`, `weight_sync`), nothing else.

Async GRPO, rollout and training as separate processes around one cluster:

- `rollout_worker`, `async_trainer`: the two sides (`python -m recipes.<name> --address A ...`);
  `channels` names what they share through the cluster (partitions, announced records)
- `experiments`: runs configs one after another with equal resources (`report` compares them);
  `demo` is one fully async run (`make demo`); `colocated` the one-process synchronous baseline
- `config` (+ `configs/*.yaml`): the OmegaConf schema, in verl's terms
- `task`, `policy`, `engines/` (torch, hf, vllm), `grpo` (advantages, losses), `learner` (a step),
  `records` (`steps.jsonl`, `run.json`)
- `dataflow_demo`: a GRPO-shaped data flow with synthetic tensors (two producers, two consumer
  tasks), kept as an example of the raw API
"""
