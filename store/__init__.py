"""Persistent store for observations, policy state, the model registry and tuning studies."""

from store.schema import SCHEMA_VERSION
from store.store import ArmStats, Store, StoreError, default_url

__all__ = ["ArmStats", "SCHEMA_VERSION", "Store", "StoreError", "default_url"]
