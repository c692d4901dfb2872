"""Configs: the sections of what a run computes (sections, models), of how it runs (runtime), their rules, loading and the reference."""
