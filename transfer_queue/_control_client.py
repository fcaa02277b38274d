"""`ControlClient`: the blocking controller-only face (status, versions, announce and lookup,
seal) for processes that have no business loading torch: the CLI, the weight channel.
"""

from __future__ import annotations

from collections.abc import Iterator

from ._control import ControlCore
from ._drivers import SyncDriver
from .wire.rpc import GRACE, Credentials

__all__ = ["ControlClient"]


class ControlClient(SyncDriver):
    """A blocking client for the controller-only calls, without torch: status, versions,
    announce/lookup, seal (`Client` adds the data plane to them). Use it as a context manager
    or `close()` it.

    Args:
        address: the controller's endpoint (`cluster.address`).
        credentials: CurveZMQ keys for a cluster bound beyond loopback (default:
            `SLUICE_CREDENTIALS`).
        timeout: seconds to wait for the controller's answer to a call without a timeout of
            its own (and for a connection to it).

    Every call raises `ServiceError` when the controller is down or silent, and `ClosedError`
    after `close()`.
    """

    def __init__(self, address: str, credentials: Credentials | None = None, timeout: float = GRACE):
        super().__init__(ControlCore(address, credentials, timeout))

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def status(self) -> dict:
        """A dict: partitions with per-task counts, versions, staleness histogram, admission, bytes.

        Raises:
            TimeoutError: the controller did not answer within the client's `timeout`.
        """
        return self._run(self._core.status())

    @property
    def version(self) -> int:
        """The trainer's current weight version."""
        return self.get_version()

    def get_version(self) -> int:
        """The trainer's current weight version."""
        return self._run(self._core.get_version())

    def set_version(self, version: int) -> int:
        """Record the trainer's new weight version; returns it.

        Raises:
            VersionError: `version` is below the current one (versions are monotone).
            SchemaError: `version` is not an int >= 0.
        """
        return self._run(self._core.set_version(version))

    def wait_version(self, version: int, timeout: float = 30.0) -> int:
        """Block until the version is at least `version`; returns the current version.

        Raises:
            TimeoutError: it did not get there within `timeout` seconds.
        """
        return self._run(self._core.wait_version(version, timeout))

    def versions(self, timeout: float = 1e9, after: int | None = None) -> Iterator[int]:
        """Every version the trainer sets after `after` (default: the version at this call), in
        order, none skipped.

        Raises:
            TimeoutError: (from the iterator) no new version within `timeout` seconds.
        """
        return self._iterate(self._core.versions(self.get_version() if after is None else after, timeout))

    def announce(self, key: str, value: bytes) -> None:
        """Publish a small value (≤ 1 MiB) under `key` for other clients to `lookup`.

        Raises:
            SchemaError: `value` is not bytes, or too large.
        """
        self._run(self._core.announce(key, value))

    def lookup(self, key: str, timeout: float = 0.0) -> bytes | None:
        """The value announced under `key`, waiting up to `timeout` s for it; None if absent."""
        return self._run(self._core.lookup(key, timeout))

    def seal(self, partition: str = "train") -> None:
        """No more samples will come to `partition`; streams end once it is drained."""
        self._run(self._core.seal(partition))
