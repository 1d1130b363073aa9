"""One team budget over several jobs on one control host (issue 33): ``fleetd team`` runs the
allocator (fleetd/policy/team.py) over every job's daemon and hands each its allotment."""
