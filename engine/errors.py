"""Errors the engine raises for bad requests, so callers can tell them from crashes."""


class EngineError(Exception):
    """Base class for every error the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """The request itself is wrong: empty prompt, K out of range, unknown drafter, ..."""


class IncompatibleDrafterError(EngineError, ValueError):
    """A drafter cannot serve this target, e.g. its vocabulary differs."""
