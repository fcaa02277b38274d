"""The public contract: names are fixed (README, "The API"; checks outside the repo call them) and every public callable is documented."""

from __future__ import annotations

import builtins
import inspect

import transfer_queue as tq
from transfer_queue.wire.errors import error_code, error_from_code

CONTRACT = {
    "init",
    "connect",
    "connect_async",
    "Cluster",
    "Client",
    "AsyncClient",
    "Grant",
    "BatchMeta",
    "StalenessConfig",
    "SluiceError",
    "TimeoutError",
    "CapacityError",
    "SchemaError",
    "ProtocolError",
    "StaleError",
    "SealedError",
    "VersionError",
    "ServiceError",
    "InternalError",
    "UnsatisfiableError",
    "ClosedError",
    "LeaseExpiredError",
    "GpuStagingStoppedError",
}
CLIENT_METHODS = {
    "acquire",
    "put",
    "get_meta",
    "get_data",
    "ack",
    "nack",
    "stream",
    "clear",
    "clear_partition",
    "seal",
    "set_version",
    "wait_version",
    "versions",
    "status",
    "close",
}


def test_contract_names_exist():
    assert set(tq.__all__) >= CONTRACT
    for name in tq.__all__:
        assert getattr(tq, name) is not None
    for cls in (tq.Client, tq.AsyncClient):
        assert set(dir(cls)) >= CLIENT_METHODS, CLIENT_METHODS - set(dir(cls))
    assert isinstance(inspect.getattr_static(tq.Client, "version"), property)
    assert inspect.iscoroutinefunction(tq.AsyncClient.get_version)


def test_error_tree():
    for name in ("TimeoutError", "CapacityError", "SchemaError", "ProtocolError", "StaleError", "SealedError"):
        assert issubclass(getattr(tq, name), tq.SluiceError)
    assert issubclass(tq.TimeoutError, builtins.TimeoutError)
    assert issubclass(tq.SchemaError, ValueError)
    for name in ("ServiceError", "InternalError", "ClosedError", "WeightSyncError", "VersionError"):
        assert issubclass(getattr(tq, name), tq.SluiceError)
    assert "InternalError" in tq.__all__
    assert not issubclass(tq.InternalError, tq.ServiceError), "a bug is not a dead service: who acts differs"
    # a subscriber falls back to host staging on this error alone, so it must cross the wire typed
    assert issubclass(tq.GpuStagingStoppedError, tq.WeightSyncError)
    refused = error_from_code(error_code(tq.GpuStagingStoppedError("no CUDA")), "no CUDA")
    assert type(refused) is tq.GpuStagingStoppedError


def test_every_public_callable_has_a_docstring():
    missing = []
    for name in tq.__all__:
        obj = getattr(tq, name)
        if callable(obj) and not (obj.__doc__ or "").strip():
            missing.append(name)
        if inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if not attr.startswith("_") and callable(member) and not (member.__doc__ or "").strip():
                    missing.append(f"{name}.{attr}")
    assert not missing, missing


def test_both_clients_write_out_every_method_with_the_same_typed_signature():
    """Methods are defined in the class body (an IDE and a type checker read them), not
    generated; the async one mirrors the blocking one parameter for parameter."""
    for method in (
        "put",
        "get_meta",
        "get_data",
        "ack",
        "nack",
        "acquire",
        "release",
        "seal",
        "clear",
        "clear_partition",
        "set_version",
        "get_version",
        "wait_version",
        "status",
        "announce",
        "lookup",
        "save_checkpoint",
        "restore_checkpoint",
        "stream",
        "versions",
    ):
        sync_fn, async_fn = vars(tq.Client)[method], vars(tq.AsyncClient)[method]
        assert not hasattr(sync_fn, "__wrapped__") and not hasattr(async_fn, "__wrapped__")
        assert inspect.signature(sync_fn).parameters == inspect.signature(async_fn).parameters, method
        assert all(
            p.annotation is not inspect.Parameter.empty
            for p in list(inspect.signature(sync_fn).parameters.values())[1:]
        ), method
        if method not in ("stream", "versions"):
            assert inspect.iscoroutinefunction(async_fn), method


def test_control_client_imports_without_torch():
    import subprocess
    import sys

    code = "import sys, transfer_queue as tq; tq.ControlClient; import transfer_queue.cli; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_init_overloads_follow_the_cluster_signature():
    """`tq.init`'s typed keyword form is Sluice's `init` parameter for parameter, so the overload
    users' checkers read cannot drift from what runs."""
    import sys
    import typing

    import pytest

    if sys.version_info < (3, 11):
        pytest.skip("typing.get_overloads needs Python 3.11")
    from transfer_queue import _cluster
    from transfer_queue.compat import face

    overloads = typing.get_overloads(face.init)
    assert len(overloads) == 3
    keyword_form = inspect.signature(overloads[-1])
    cluster_init = inspect.signature(_cluster.init)
    assert [(p.name, p.kind, p.default) for p in keyword_form.parameters.values()] == [
        (p.name, p.kind, p.default) for p in cluster_init.parameters.values()
    ]
    assert str(keyword_form.return_annotation) == "Cluster"


def test_wire_imports_without_torch():
    """The wire is the floor every service stands on: importing all of it loads neither torch nor tensordict."""
    import subprocess
    import sys

    code = (
        "import sys, transfer_queue.wire.messages, transfer_queue.wire.rpc, transfer_queue.wire.auth, "
        "transfer_queue.wire.sizes; assert not {'torch', 'tensordict'} & set(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_packages_ship_type_hints():
    from pathlib import Path

    import weight_sync

    for package in (tq, weight_sync):
        assert (Path(package.__file__).parent / "py.typed").is_file(), package.__name__
