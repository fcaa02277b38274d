"""TransferQueue 0.1.11's API on Sluice, so verl's code runs unchanged with `import transfer_queue`.

- `face`: the module functions (`init(conf)`, `kv_*` and their `async_` twins, `get_client`,
  `close`, `get_metrics_endpoint`).
- `client`: `TransferQueueClient`.
- `kv_meta`: `KVBatchMeta`.
- `checkpoint`: `save_checkpoint` / `load_checkpoint`.

`BatchMeta` is one class for both APIs: Sluice's struct (`transfer_queue.wire.meta`), which also
answers TransferQueue's `BatchMeta` operations. Where this face differs from TransferQueue on
purpose, docs/verl.md lists it.
"""
