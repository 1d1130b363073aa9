"""The planner's stages, in the order ``fleetd.policy.planner.plan`` runs them.

Each stage reads and updates one pass's working state (pass_state.PlanPass); the decisions live in
the pure modules one level up, and no stage reads a clock or does I/O. Planner steps: 1
terminations.py (stop.py for a stop already issued), 3 checkpoints.py, 4 target.py and sizing.py,
5 and 6 buying.py; result.py builds the Plan (docs/DESIGN.md "Layers").
"""
