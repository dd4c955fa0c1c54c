"""The two ways a protocol exchange can go wrong.

`ProtocolError`: our own side fed a state machine an input its transition table does not allow
in the current state (a driver bug). `PeerError`: the other side sent something that cannot be
right (a notification from a rank that was never expected, a registration whose block count does
not fit the request). Drivers record a `PeerError` and fall back; a `ProtocolError` is a bug.
`SchemaError` is raised when an event (or its serialised payload) does not fit its schema.
"""

from __future__ import annotations


class KvplaneError(Exception):
    """Base class of every error the core raises."""


class ProtocolError(KvplaneError):
    """Our side used the protocol wrongly: the input is not allowed in the current state."""

    def __init__(self, machine: str, state: str = "", given: str = "", detail: str = "") -> None:
        self.machine, self.state, self.given, self.detail = machine, state, given, detail
        # args are the constructor's own, so the error can be rebuilt from them (SimPy does)
        super().__init__(machine, state, given, detail)

    def __str__(self) -> str:
        msg = f"{self.machine}: input {self.given!r} is not allowed in state {self.state!r}"
        return f"{msg}: {self.detail}" if self.detail else msg


class PeerError(KvplaneError):
    """The peer misbehaved: what it sent contradicts what was agreed."""


class SchemaError(KvplaneError, ValueError):
    """An event or payload does not match the schema of its type."""
