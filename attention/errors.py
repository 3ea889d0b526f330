"""Errors of the attention package (a leaf: it imports nothing from the engine)."""


class BackendUnavailableError(RuntimeError):
    """An explicitly chosen attention backend cannot run with this device / dtype / head size."""


class UnknownBackendError(ValueError):
    """No backend of that name is registered."""
