"""One reconcile pass = observe -> plan -> act -> record; the daemon repeats it (fleetd.daemon)."""
