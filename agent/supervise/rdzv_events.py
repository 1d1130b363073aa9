"""torchrun's rendezvous names each of its events by walking the whole call stack: make that cheap.

Every rendezvous operation torchrun's agent runs (each sync, each join step, each keep-alive)
records an event named after the calling method, and torch finds that name with
``inspect.stack()``, twice: it builds every frame's source context, reading and stat-ing the
source file of each of ~30 frames. That is 20-50 ms of CPU per event, a dozen events per re-form:
sampling the agents' stacks showed them busy ~0.5 s of a notice's ~1 s re-form inside
``get_method_name``, and the keep-alive thread paying it once a second while training
(docs/measurements/2026-11-rendezvous.md). The events go to a null handler by default anyway.
:func:`install` (agent/supervise/torchrun_main.py) swaps in the same answer read from the frame
directly. A torch without the helper is left as is (slower, still correct).
"""

from __future__ import annotations

import sys


def method_name(depth: int = 2) -> str:
    """What torch's ``get_method_name`` returns (``inspect.stack()[depth].function``, counted
    from this function's own frame), without building the stack."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # the stack is not that deep
        return "no_method_name"


def install() -> bool:
    try:
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
    except ImportError:
        return False
    if not callable(getattr(dr, "get_method_name", None)):
        return False
    dr.get_method_name = method_name
    return True
