"""Tests of app/bench: make bench and the quality guard."""
