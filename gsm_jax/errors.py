"""Exceptions raised by gsm-jax. Each names the problem in its message."""

from __future__ import annotations


class GSMJaxError(Exception):
    """Base class of every error gsm-jax raises on purpose."""


class ModelNotFoundError(GSMJaxError, FileNotFoundError):
    """An unknown model name, or a path that does not exist."""


class ModelLoadError(GSMJaxError, ValueError):
    """A model file or directory that exists but cannot be read (truncated, corrupt)."""


class UnsupportedModelError(GSMJaxError, ValueError):
    """A model whose architecture or configuration gsm-jax does not implement."""


class InvalidInputError(GSMJaxError, ValueError):
    """Bad arguments to generate/forward: empty prompts, over-long prompts, bad sizes."""


class GSMConfigError(GSMJaxError, ValueError):
    """An invalid GSM configuration; the message names the key."""
