"""Adaptive autotuning controller for speculative decoding."""

from autotune.control.controller import AutotuneController, ControlledResult, default_arms

__all__ = ["AutotuneController", "ControlledResult", "default_arms"]
