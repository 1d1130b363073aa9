"""The rendezvous adapter's own error types (library errors are translated into these)."""


class RendezvousError(Exception):
    """Base of every error fleetd's rendezvous code raises."""


class RendezvousUnavailable(RendezvousError):
    """The rendezvous store cannot be reached (host down, network, timeout)."""


class RendezvousStateError(RendezvousError):
    """The stored rendezvous state is not a value fleetd can read (corrupt, foreign, unsafe)."""


class RendezvousConflict(RendezvousError):
    """A compare-and-set kept losing to concurrent writers."""
