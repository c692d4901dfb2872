"""wm: a minimal trainer for 3D occupancy world models (OccWorld family)."""

__version__ = "0.1.0"
