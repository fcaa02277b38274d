"""Sluice's TransferQueue face against TransferQueue 0.1.11's own, signature by signature.

The session fixture downloads TransferQueue 0.1.11 from PyPI (`pip download --no-deps`) and
unpacks it into a scratch directory; `tq_signatures.py` runs once with that directory first on
`PYTHONPATH` (so TransferQueue is imported there, never in this process) and once on Sluice.
Every public function, method and property of TransferQueue's face must exist on Sluice's with
the same kind, and every parameter with the same name, position and default; Sluice may add
parameters only with defaults. `DIFFERENCES` lists the deliberate exceptions with their reasons;
a difference not listed, or listed but gone, fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("verl")  # the verl environment (`make verl-test`) holds TransferQueue's dependencies

TQ_VERSION = "0.1.11"
HERE = Path(__file__).parent
ROOT = HERE.parent.parent

_STREAMING = (
    "TransferQueue's streaming (non-key) consumer protocol: Sluice's own Client.get_meta/ack with "
    "leases and staleness replaces it; verl's V1 trainer reads and writes through the KV API only"
)
_SCHEMA = (
    "TransferQueue's per-sample storage schema; Sluice's BatchMeta is the controller's wire struct "
    "(one FieldSpec per field in `fields`, readiness tracked by the controller), handed out by the "
    "store or BatchMeta.empty(), never built by callers"
)
_CUSTOM = "per-sample custom metadata: Sluice keeps per-key tags (the KV API's tags) instead"
_CHECKPOINT = "tq.save_checkpoint/load_checkpoint save and load controller and storage state in one step"
_SOCKET = "TransferQueue's internal ZeroMQ socket injection; callers never pass it"

DIFFERENCES: dict[str, str] = {
    # an entry `name` covers all of `name`'s parameters
    "init": (
        "one `init(*args, **kwargs)` serves TransferQueue's `init(conf=None)` (a mapping or no "
        "argument: TransferQueue's meaning) and Sluice's own keyword `init` (tests/transfer_queue/test_tq_face.py)"
    ),
    "BatchMeta.__init__": _SCHEMA,
    "BatchMeta.field_schema": _SCHEMA,
    "BatchMeta.production_status": _SCHEMA,
    "BatchMeta.samples": _SCHEMA,
    "BatchMeta.get_dtypes": _SCHEMA,
    "BatchMeta.get_shapes": _SCHEMA,
    "BatchMeta.add_fields": _SCHEMA + "; a put returns the batch with its new fields",
    "BatchMeta.custom_meta": _CUSTOM,
    "BatchMeta.get_all_custom_meta": _CUSTOM,
    "BatchMeta.update_custom_meta": _CUSTOM,
    "BatchMeta.clear_custom_meta": _CUSTOM,
    "TransferQueueClient.set_custom_meta": _CUSTOM,
    "TransferQueueClient.async_set_custom_meta": _CUSTOM,
    "TransferQueueClient.__init__": "made by tq.get_client() from the cluster's address, not from TransferQueue's ZMQServerInfo",
    "TransferQueueClient.initialize_storage_manager": "Sluice's storage units are started and reached by tq.init",
    "TransferQueueClient.async_kv_list(socket)": _SOCKET,
    "TransferQueueClient.async_kv_retrieve_keys(socket)": _SOCKET,
    "TransferQueueClient.async_kv_retrieve_meta(socket)": _SOCKET,
    **{
        f"TransferQueueClient.{prefix}{name}": _STREAMING
        for prefix in ("", "async_")
        for name in (
            "get_meta",
            "check_consumption_status",
            "get_consumption_status",
            "reset_consumption",
            "check_production_status",
            "get_production_status",
            "get_partition_list",
            "clear_partition",
        )
    },
    **{
        f"TransferQueueClient.{prefix}{op}_{what}_checkpoint": _CHECKPOINT
        for prefix in ("", "async_")
        for op in ("save", "load")
        for what in ("controller", "storage")
    },
}


@pytest.fixture(scope="session")
def transfer_queue_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """TransferQueue 0.1.11 from PyPI, unpacked where only an explicit PYTHONPATH reaches it."""
    where = tmp_path_factory.mktemp("transferqueue")
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"TransferQueue=={TQ_VERSION}", "-d", str(where)],
        check=True,
        timeout=300,
    )
    (wheel,) = where.glob("*.whl")
    unpacked = where / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(unpacked)
    return unpacked


def signatures(first_on_path: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(first_on_path)}
    out = subprocess.run(
        [sys.executable, str(HERE / "tq_signatures.py")], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def problems(reference: dict[str, dict], ours: dict[str, dict]) -> dict[str, str]:
    """`name` or `name(param)` -> what differs, for every way `ours` may refuse a call written for `reference`."""
    found: dict[str, str] = {}
    for name, want in reference.items():
        got = ours.get(name)
        if got is None:
            found[name] = "missing"
            continue
        if got["kind"] != want["kind"]:
            found[name] = f"a {got['kind']}, TransferQueue's is a {want['kind']}"
            continue
        mine = {p[0]: p for p in got["params"]}
        kinds = {p[1] for p in got["params"]}
        positional = [p[0] for p in got["params"] if p[1] in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")]
        wanted_positional = [p[0] for p in want["params"] if p[1] in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")]
        for pname, pkind, default in want["params"]:
            key = f"{name}({pname})"
            if pkind in ("VAR_POSITIONAL", "VAR_KEYWORD"):
                if pkind not in kinds:
                    found[key] = f"no {pkind}"
            elif pname not in mine:
                found[key] = "takes *args/**kwargs instead" if {"VAR_POSITIONAL", "VAR_KEYWORD"} & kinds else "missing"
            elif mine[pname][2] != default:
                found[key] = f"default {mine[pname][2] or 'none'}, TransferQueue's {default or 'none'}"
            elif pkind != "KEYWORD_ONLY" and positional.index(pname) != wanted_positional.index(pname):
                found[key] = f"at position {positional.index(pname)}, TransferQueue's {wanted_positional.index(pname)}"
            elif pkind == "KEYWORD_ONLY" and mine[pname][1] == "POSITIONAL_ONLY":
                found[key] = "positional only"
        wanted_names = {p[0] for p in want["params"]}
        for pname, pkind, default in got["params"]:
            if pname not in wanted_names and not default and pkind not in ("VAR_POSITIONAL", "VAR_KEYWORD"):
                found[f"{name}({pname})"] = "required by Sluice only"
    return found


def test_sluice_accepts_every_call_transfer_queue_does(transfer_queue_wheel: Path) -> None:
    reference = signatures(transfer_queue_wheel)
    ours = signatures(ROOT)
    assert reference["file"].startswith(str(transfer_queue_wheel)), reference["file"]
    assert Path(ours["file"]).is_relative_to(ROOT), ours["file"]
    assert len(reference["signatures"]) > 60  # the face was really read
    found = problems(reference["signatures"], ours["signatures"])
    unexpected = {k: v for k, v in found.items() if k not in DIFFERENCES and k.split("(")[0] not in DIFFERENCES}
    gone = sorted(d for d in DIFFERENCES if not any(k == d or k.startswith(d + "(") for k in found))
    assert not unexpected, f"differences from TransferQueue {TQ_VERSION} not listed in DIFFERENCES: {unexpected}"
    assert not gone, f"listed in DIFFERENCES but no longer different: {gone}"
