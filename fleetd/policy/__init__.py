"""Pure decisions: plain frozen data in, typed actions (each with a reason) out.

No asyncio, no boto, no MQTT, no torch, no clock reads, no I/O: ``now`` is always passed in.
The daemon (fleetd/reconcile), the simulator (fleetd/sim) and the unit tests call the same code.
Enforced by tests/test_import_contract.py.

- planner.py: ``plan(obs, cfg, now) -> Plan``, the one entry point; composes the modules below.
- stages/: the planner's steps, each applying the modules below to one pass's working state.
- observation.py: what a pass sees (Observation, PoolStats); model.py: nodes, offers, actions.
- lifecycle.py: the two-signal rule (which nodes are lost).
- budget.py: graded level from the forecast, commitments, and the gate every launch passes.
- rebalance.py: notices -> drain; rebalance recommendations -> pre-buy / checkpoint.
- scaling.py: target node count (utilisation, marginal efficiency, hysteresis, cool-down).
- placement.py: pool ranking, interruption-rate prior blend, diversification.
- ledger.py: spend and goodput from the persisted event list (fleetd.reconcile.ledger_store).
"""
