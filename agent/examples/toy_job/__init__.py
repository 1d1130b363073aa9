"""The demo's toy job as a user project: its training script, requirements and job file."""
