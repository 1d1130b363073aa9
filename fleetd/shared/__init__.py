"""Plumbing both daemons use, and the only fleetd package besides ``fleetd.protocol`` the agent may
import: the config groups and their loader, the log format, cancellation-safe waits, the retry
schedule, systemd's notify protocol, failpoints, MQTT connection options, the AWS region's
resolution, the supported torch releases and the safe decoder of torch's rendezvous state.
What crosses a process boundary (messages, topics, store keys, the S3 layout) is in
``fleetd.protocol``, which imports nothing from here (docs/DESIGN.md, "Layers")."""
