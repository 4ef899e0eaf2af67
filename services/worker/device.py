"""Which device the worker runs on: the one place that asks torch (shared/config.py never imports it)."""

from __future__ import annotations

import torch

from pagoda.shared.config import EngineConfig


def resolve_device(config: EngineConfig) -> str:
    """config.device, or for "auto" cuda when torch sees a GPU, else cpu."""
    if config.device != "auto":
        return config.device
    return "cuda" if torch.cuda.is_available() else "cpu"
