"""The training precision as a context: autocast to a dtype on a device, or nothing for fp32."""

from __future__ import annotations

import contextlib
from typing import Optional

import torch


def autocast(device: torch.device, dtype: Optional[torch.dtype]):
    """Autocast to `dtype` on `device`, or nothing for fp32 (None)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
