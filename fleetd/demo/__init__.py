"""`fleetd demo`: the whole loop on one machine (a local cloud, a broker, agents, real torchrun)."""
