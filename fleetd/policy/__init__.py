"""Pure decisions: plain frozen data in, typed actions (each with a reason) out.

No asyncio, no boto, no MQTT, no torch, no clock reads, no I/O: ``now`` is always passed in.
The daemon (fleetd/reconcile), the simulator (fleetd/sim) and the unit tests call the same code.
Enforced by tests/test_import_contract.py.
"""
