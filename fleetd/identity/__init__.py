"""Node identity: the fleet CA, instance identity document checks, and the enrolment endpoint."""
