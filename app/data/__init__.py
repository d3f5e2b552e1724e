"""Criteo data: raw TSV reading and the synthetic sample generator."""
