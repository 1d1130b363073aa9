"""Test harness: real services on random ports (moto server, mosquitto)."""
