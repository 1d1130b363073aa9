"""fleetd: spot-fleet orchestration for elastic GPU training (controller side)."""

__version__ = "0.1.0"
