"""torchrun copies each worker's output to its own with a thread per stream that polls the
worker's log file every 0.1 s, and stopping a worker group waits for those threads to see that
they are finished: stdout's, then stderr's, each at its next poll. That is up to 0.2 s (0.1 s
on average) of every re-form, spent after the old workers have already exited and before this
node rejoins; a round completes when its slowest node is back, so the whole job waits for it.

:func:`install` (agent/supervise/torchrun_main.py) makes the poll ``POLL_S``. The cost is one
``readline`` at EOF per stream per poll. A torch whose ``TailLog`` changed is left as is
(slower, still correct).
"""

from __future__ import annotations

POLL_S = 0.02
TORCH_DEFAULT_S = 0.1


def install(poll_s: float = POLL_S) -> bool:
    try:
        from torch.distributed.elastic.multiprocessing.tail_log import TailLog
    except ImportError:
        return False
    defaults = TailLog.__init__.__defaults__
    # (log_line_prefixes, interval_sec, log_line_filter): torch's PContext passes no interval.
    if not defaults or len(defaults) != 3 or defaults[1] != TORCH_DEFAULT_S:
        return False
    TailLog.__init__.__defaults__ = (defaults[0], poll_s, defaults[2])
    return True
