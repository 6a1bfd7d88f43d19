"""Errors the engine raises for bad input. The CLI prints their message and exits non-zero."""


class EngineError(Exception):
    """Base class: a problem with what the caller asked for, not a bug."""


class ConfigError(EngineError, ValueError):
    """A model or engine configuration that cannot be served (unknown architecture, bad field)."""


class WeightsError(EngineError):
    """Weight files that are missing, corrupt, or do not fit the configuration."""


class RequestError(EngineError, ValueError):
    """A request that cannot be served: prompt too long, invalid sampling parameters. ``param``: the request
    field at fault, where one is (the server's error body names it)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class VariantError(EngineError):
    """A variant that cannot be applied; the previous variant stays active."""
