"""Errors of the HA layer, importable by the reconcile loop without importing the HA adapters."""

from __future__ import annotations


class LeaseLost(Exception):
    """This process is not (or no longer) the leader: a write was refused by the lease's fence,
    or the lease expired by this host's own clock before a renewal succeeded. Whatever the
    caller was about to do (write state, launch, terminate) must not happen; the process goes
    back to standby. Not an AwsError on purpose: the loop must never treat it as a transient
    failure to retry."""
