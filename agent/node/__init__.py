"""The node's senses and voice: IMDSv2 (notices, identity), telemetry, the MQTT session with its
on-disk outbox, and the channel on which the in-process trainer reports progress to the agent."""
