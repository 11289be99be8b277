"""Policies choose an arm per request and learn from the outcome."""

from engine import Arm
from policies.bandits import BanditPolicy, ThompsonPolicy, UCBPolicy
from policies.base import LOAD_BUCKETS, Context, Outcome, Policy, PolicyError, load_bucket
from policies.contextual import ContextualPolicy
from policies.static import HeuristicPolicy, OffPolicy, StaticPolicy

POLICIES = {
    "static": StaticPolicy,
    "off": OffPolicy,
    "heuristic": HeuristicPolicy,
    "ucb": UCBPolicy,
    "thompson": ThompsonPolicy,
    "contextual": ContextualPolicy,
}


def make_policy(name: str, arms: list[Arm], **kwargs) -> Policy:
    """Build a policy by name; static and heuristic take `arm=` (e.g. arm="small:4")."""
    if name not in POLICIES:
        raise PolicyError(f"unknown policy {name!r}; choose one of: {', '.join(POLICIES)}")
    return POLICIES[name](arms, **kwargs)


__all__ = [
    "LOAD_BUCKETS", "POLICIES", "BanditPolicy", "Context", "ContextualPolicy", "HeuristicPolicy", "OffPolicy",
    "Outcome", "Policy", "PolicyError", "StaticPolicy", "ThompsonPolicy", "UCBPolicy", "load_bucket", "make_policy",
]
