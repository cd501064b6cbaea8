"""The configuration error type, in a module of its own so every config module can import it at the top."""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad configuration; the message is one line that names the key and, if any, the file."""
