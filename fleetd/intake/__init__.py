"""The controller's event intake: MQTT from the agents and EventBridge via SQS, merged in the
node registry that the reconcile loop reads. Both intakes produce ``fleetd.intake.events``."""
