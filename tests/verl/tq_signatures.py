"""Print, as JSON, the signature of every public callable of whichever `transfer_queue` this
interpreter imports: TransferQueue 0.1.11's (its unpacked wheel first on `PYTHONPATH`) or Sluice's.

Run as a script by test_tq_parity.py, once per side, so TransferQueue is never importable as
`transfer_queue` in the test's own process. Entries: `name` or `Class.member` ->
`{"kind": "function" | "method" | "property", "params": [[name, kind, default]]}`; a
default is its `repr` ("" when there is none), `self`/`cls` left out.
"""

from __future__ import annotations

import inspect
import json
import sys

FUNCTIONS = [
    "init",
    "close",
    "get_client",
    "get_metrics_endpoint",
    "kv_put",
    "kv_batch_put",
    "kv_batch_get",
    "kv_batch_get_by_meta",
    "kv_list",
    "kv_clear",
    "async_kv_put",
    "async_kv_batch_put",
    "async_kv_batch_get",
    "async_kv_batch_get_by_meta",
    "async_kv_list",
    "async_kv_clear",
    "save_checkpoint",
    "load_checkpoint",
]
CLASSES = ["BatchMeta", "KVBatchMeta", "TransferQueueClient"]
DUNDERS = {"__init__", "__len__", "__getitem__"}


def params(fn: object) -> list[list[str]]:
    sig = inspect.signature(fn)
    return [
        [p.name, p.kind.name, "" if p.default is inspect.Parameter.empty else repr(p.default)]
        for p in sig.parameters.values()
        if p.name not in ("self", "cls")
    ]


def face() -> dict[str, dict]:
    import transfer_queue as tq

    out: dict[str, dict] = {}
    for name in FUNCTIONS:
        out[name] = {"kind": "function", "params": params(getattr(tq, name))}
    for cls_name in CLASSES:
        cls = getattr(tq, cls_name)
        for name in dir(cls):
            if name.startswith("_") and name not in DUNDERS:
                continue
            static = inspect.getattr_static(cls, name)
            if isinstance(static, property) or not callable(getattr(cls, name)):
                out[f"{cls_name}.{name}"] = {"kind": "property", "params": []}
            else:
                out[f"{cls_name}.{name}"] = {"kind": "method", "params": params(getattr(cls, name))}
    return out


if __name__ == "__main__":
    signatures = face()
    json.dump({"file": sys.modules["transfer_queue"].__file__, "signatures": signatures}, sys.stdout)
