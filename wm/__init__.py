"""wm: a minimal trainer for 3D occupancy world models (OccWorld family)."""

from wm.version import __version__  # noqa: F401


def __getattr__(name):
    """`from wm import Forecaster` without importing torch and the models on every `import wm`."""
    if name == "Forecaster":
        from wm.forecaster import Forecaster

        return Forecaster
    raise AttributeError(f"module 'wm' has no attribute {name!r}")
