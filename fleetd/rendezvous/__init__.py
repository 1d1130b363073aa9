"""The rendezvous adapter: the long-lived store host, torchrun's state as plain data, and the
client fleetd reads and steers the rendezvous with."""
