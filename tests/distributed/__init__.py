"""Tests of app/distributed: sharding plans, topology presets, launch, rendezvous and cluster failures."""
