"""The wire: everything two Sluice processes agree on, and nothing else. Torch-free.

This is the floor every service and transport stands on: the controller, the storage units,
the weight channel and the clients import it; it imports nothing of Sluice above it (and
neither torch nor tensordict), so a service process starts without loading them.

- `rpc`: the request/reply kernel every process uses (framing and limits, the message base,
  error replies, the asyncio and thread service loops, blocking and asyncio channels).
- `messages`: the controller's and storage units' messages, one tagged union per service.
- `meta`: `BatchMeta` and `FieldSpec`, the metadata of a batch (never holds tensors).
- `errors`: the exception tree under `SluiceError`, and its codes on the wire.
- `staleness`: the staleness settings and the admission limit they imply.
- `auth`: CurveZMQ credentials, and the rule for when they are required.
- `sizes`: byte sizes written as text ("2GiB").
"""
