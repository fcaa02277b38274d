"""The public contract: names are fixed (README, "The API"; checks outside the repo call them) and every public callable is documented."""

from __future__ import annotations

import builtins
import inspect

import transfer_queue as tq

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
