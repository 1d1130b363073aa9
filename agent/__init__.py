"""fleet-agent: the on-node agent (IMDS watcher, telemetry, torchrun supervisor, checkpoints).

It imports nothing from fleetd except ``fleetd.protocol`` (enforced by tests/test_import_contract.py).
"""

__version__ = "0.1.0"
