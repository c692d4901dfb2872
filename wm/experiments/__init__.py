"""Comparing runs: the regression gate between two trained world models."""
