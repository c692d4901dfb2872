"""Evaluation under OccWorld's protocol: metrics, the evaluation run, the final table."""
