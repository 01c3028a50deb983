"""Transports move frames between ranks; see ``asynccoll.transport.base``."""

from .base import Key, Mailbox, Transport

__all__ = ["Key", "Mailbox", "Transport"]
