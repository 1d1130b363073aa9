"""Subcommands of `fleetd`; see fleetd/cli.py for the table."""
