"""Trace-driven simulation of fleetd and of the recovery strategies it is compared with.

engine.py (discrete-event world), books.py (the job's accounting), traces.py (readers and synthetic traces), job.py
(the training job), policies.py (baselines), deadline_fleet.py (deadline baselines for N nodes),
deadline.py (deadline sweeps), fleetd_policy.py (fleetd's planner, driven with a virtual clock;
fleetd_observe.py builds its Observation, fleetd_actions.py carries out its actions), scenario.py / options.py (what `fleetd simulate` runs), whatif.py (`fleetd
plan`), planner_tools.py (Young/Daly, S3 cost, plots), defaults.py (every default and its source).
"""
