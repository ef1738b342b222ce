"""Errors a user can cause and fix: each message names the problem and, where possible, the remedy."""


class SpecairError(Exception):
    """Base of every error specair reports to a user without a traceback."""


class ModelFormatError(SpecairError):
    """A model file or directory is missing, corrupt, truncated or of an unsupported kind."""


class InputError(SpecairError):
    """A request cannot be served as given (prompt too long, bad token ids, bad sampling values)."""
