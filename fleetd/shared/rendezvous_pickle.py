"""The one decoder of torch's pickled rendezvous state, for the controller and the agent alike.

torch keeps run ``<run_id>``'s state under ``torch.rendezvous.<run_id>`` as base64(pickle(...)).
The store is unauthenticated (docs/DESIGN.md "Node identity and the threat model"), so
:func:`unpickle_rendezvous_state` resolves only the classes torch puts there, and
tests/test_one_unpickler.py fails on a ``pickle.loads`` anywhere else in fleetd/ or agent/. It is in
fleetd.shared so the agent may import it; torch is imported only when a value names its classes.
"""

from __future__ import annotations

import base64
import io
import pickle
from typing import Any

from fleetd.protocol.errors import ProtocolError

# The c10d backend writes this sentinel when it creates the key ("no state yet").
NULL_SENTINEL = b"Y2FuaW1hZGFt"
_TORCH_MODULE = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
# Everything a _RendezvousState pickles to, at any pickle protocol torch may use.
ALLOWED_CLASSES = frozenset(
    {
        (_TORCH_MODULE, "_RendezvousState"),
        (_TORCH_MODULE, "_NodeDesc"),
        ("datetime", "datetime"),
        ("datetime", "timezone"),
        ("datetime", "timedelta"),
        ("builtins", "set"),
        ("builtins", "dict"),
        ("copyreg", "_reconstructor"),
        ("builtins", "object"),
    }
)


class _AllowListUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:  # (pickle protocol)
        if (module, name) not in ALLOWED_CLASSES:
            raise ProtocolError(f"rendezvous state refers to {module}.{name}: not allowed")
        return super().find_class(module, name)


def unpickle_rendezvous_state(raw: bytes) -> Any | None:
    """torch's ``_RendezvousState`` object from the stored value; None for the "no state yet"
    sentinel. Raises ProtocolError for anything else: not base64, not a pickle, or a pickle that
    names a class outside the allow-list (nothing it names is imported or called)."""
    if raw == NULL_SENTINEL:
        return None
    try:
        data = base64.b64decode(raw, validate=True)
    except ValueError as exc:  # binascii.Error
        raise ProtocolError(f"rendezvous state is not torch's: {exc}") from None
    try:
        return _AllowListUnpickler(io.BytesIO(data)).load()
    except ProtocolError:
        raise
    except Exception as exc:
        # Garbage makes the unpickler raise nearly anything (UnpicklingError, EOFError, IndexError,
        # KeyError, struct errors, ...); with the allow-list none of it ran foreign code, and every
        # caller wants the one clear error, not a guess at the list.
        raise ProtocolError(f"rendezvous state is not torch's: {type(exc).__name__}: {exc}") from None
