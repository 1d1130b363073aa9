"""Example training scripts (used by the tests, the benchmarks and ``fleetd demo``)."""
