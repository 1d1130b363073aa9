"""Pure decisions: plain frozen data in, typed actions (each with a reason) out.

No asyncio, no boto, no MQTT, no torch, no clock reads, no I/O: ``now`` is always passed in, so the
daemon (fleetd/reconcile), the simulator (fleetd/sim) and the unit tests call the same code
(enforced by the import contracts and tests/test_import_contract.py). ``planner.plan(obs, cfg,
now)`` is the one entry point; stages/ holds its steps (docs/DESIGN.md "Layers").
"""
