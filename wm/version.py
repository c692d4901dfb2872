"""wm's version: what run records and evaluation reports name."""

__version__ = "0.1.0"
