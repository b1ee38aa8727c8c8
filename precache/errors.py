"""Errors that more than one layer raises, and how a message quotes a value it cannot trust.

``RunError`` lives here, not in ``precache.build``, so that the executors and the cache's write
transaction can raise it without importing the runner that calls them."""

from __future__ import annotations

__all__ = ["RunError", "short_repr"]


class RunError(RuntimeError):
    """The run cannot continue; the message says what happened, where, and what to do."""


def short_repr(value: object) -> str:
    """``repr`` of a value read from a manifest, cut short, for a one-line message."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."
