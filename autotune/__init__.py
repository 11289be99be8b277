"""Adaptive autotuning controller for speculative decoding."""

from autotune.control.controller import AutotuneController, ControlledResult, default_arms
from autotune.control.settings import ControllerSettings

__all__ = ["AutotuneController", "ControlledResult", "ControllerSettings", "default_arms"]
