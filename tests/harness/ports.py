from fleetd.localnet import free_port, wait_port

__all__ = ["free_port", "wait_port"]
