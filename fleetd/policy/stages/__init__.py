"""The planner's stages, in the order ``fleetd.policy.planner.plan`` runs them.

Each stage reads and updates one pass's working state (pass_state.PlanPass); the decisions
themselves live in the pure modules one level up (lifecycle, budget, rebalance, checkpointing,
scaling, placement). Like them, no stage reads a clock or does I/O.

- pass_state.py: PlanPass, the working state of one pass (actions, notes, billed and kept nodes).
- terminations.py: step 1, lost nodes, broken boots, nodes that left, overdue drains -> Terminate.
- stop.py: a stop already issued: wait for the stop reserve, then terminate what is left.
- checkpoints.py: step 3, rebalance pre-buys and checkpoints, the periodic Young/Daly checkpoint.
- target.py: step 4, the scaling target and straggler replacement.
- sizing.py: step 4, excess nodes, burn above the cap, back to spot (make-before-break).
- buying.py: steps 5 and 6, spot pool ranking, buying, on-demand fallback, the budget gate.
- result.py: the Plan with its budget status.
"""
