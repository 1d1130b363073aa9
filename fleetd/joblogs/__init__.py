"""The workers' output on the control host: written from the ``logs`` channel, read by ``fleetd logs``."""
