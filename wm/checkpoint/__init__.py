"""Run folders and checkpoint files: writing, checking, loading for resume, fine-tuning and use."""
