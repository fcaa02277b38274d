"""The public contract: names are fixed (README, "The API"; checks outside the repo call them) and every public callable is documented."""

from __future__ import annotations

import builtins
import inspect

import transfer_queue as tq

CONTRACT = {
    "init", "connect", "connect_async", "Cluster", "Client", "AsyncClient", "Grant", "BatchMeta",
    "StalenessConfig", "SluiceError", "TimeoutError", "CapacityError", "SchemaError", "ProtocolError",
    "StaleError", "SealedError", "VersionError",
}
CLIENT_METHODS = {
    "acquire", "put", "get_meta", "get_data", "ack", "nack", "stream", "clear", "clear_partition",
    "seal", "set_version", "wait_version", "versions", "status", "close",
}


def test_contract_names_exist():
    assert CONTRACT <= set(tq.__all__)
    for name in tq.__all__:
        assert getattr(tq, name) is not None
    for cls in (tq.Client, tq.AsyncClient):
        assert CLIENT_METHODS <= set(dir(cls)), CLIENT_METHODS - set(dir(cls))
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


def test_async_and_sync_clients_share_one_implementation():
    for method in ("put", "get_meta", "get_data", "ack", "acquire"):
        sync_impl = getattr(tq.Client, method).__wrapped__
        async_impl = getattr(tq.AsyncClient, method).__wrapped__
        assert sync_impl is async_impl
        assert inspect.iscoroutinefunction(getattr(tq.AsyncClient, method))
