"""A contextual policy for classes with little history of their own.

It learns reward = f(request features) per arm from every class's history (ridge
regression, scikit-learn), so a new or rare class gets an informed first choice from
requests that look like it. Once a class has `min_class_obs` requests of its own, the
per-class Thompson bandit takes over. Predictions are a numpy dot product per arm, so a
decision stays in microseconds; refits happen in `update`, every `refit_every` requests.
"""

from __future__ import annotations

import numpy as np
from sklearn.linear_model import Ridge

from engine import OFF, Arm
from policies.bandits import ThompsonPolicy
from policies.base import Context, Outcome, Policy

FEATURES = ("prompt_tokens", "max_new_tokens", "temperature", "top_p", "ngram_overlap", "load")
HISTORY_KEY = "__contextual_history__"


def feature_vector(context: Context) -> list[float]:
    f = {**context.features, "load": context.load}
    return [float(f.get(name, 0.0)) for name in FEATURES]


class ContextualPolicy(Policy):
    name = "contextual"
    learns = True

    def __init__(self, arms: list[Arm], min_class_obs: int = 20, refit_every: int = 16,
                 max_history: int = 1000, alpha: float = 1.0, **bandit_kw) -> None:
        super().__init__(arms)
        self.bandit = ThompsonPolicy(self.arms, **bandit_kw)
        self.min_class_obs = min_class_obs
        self.refit_every = refit_every
        self.max_history = max_history
        self.alpha = alpha
        self.history: list[tuple[list[float], str, float]] = []
        self.models: dict[str, tuple[np.ndarray, float]] = {}  # arm -> (weights on scaled x, bias)
        self.center = np.zeros(len(FEATURES))
        self.scale = np.ones(len(FEATURES))

    def choose(self, context: Context) -> Arm:
        table = self.bandit.table(context)
        if table.pulls >= self.min_class_obs or len(self.models) < 2 or table.counts[str(OFF)] == 0:
            return self.bandit.choose(context)
        x = (np.asarray(feature_vector(context)) - self.center) / self.scale
        best = max(self.models, key=lambda arm: float(x @ self.models[arm][0]) + self.models[arm][1])
        return self.bandit.by_name[best]

    def set_prior(self, request_class: str, priors: dict[str, tuple[float, float]]) -> None:
        self.bandit.set_prior(request_class, priors)

    def update(self, context: Context, arm: Arm, outcome: Outcome) -> None:
        self.bandit.update(context, arm, outcome)
        self.history.append((feature_vector(context), str(arm), outcome.reward))
        del self.history[: -self.max_history]
        if len(self.history) % self.refit_every == 0:
            self.refit()

    def refit(self) -> None:
        X = np.asarray([h[0] for h in self.history])
        self.center, self.scale = X.mean(0), X.std(0) + 1e-6
        Xs = (X - self.center) / self.scale
        arms = np.asarray([h[1] for h in self.history])
        y = np.asarray([h[2] for h in self.history])
        self.models = {}
        for arm in set(arms.tolist()):
            mask = arms == arm
            if mask.sum() >= 3:
                model = Ridge(alpha=self.alpha).fit(Xs[mask], y[mask])
                self.models[arm] = (model.coef_, float(model.intercept_))

    def state_dict(self) -> dict[str, dict]:
        state = self.bandit.state_dict()
        state[HISTORY_KEY] = {"history": self.history}
        return state

    def load_state_dict(self, state: dict[str, dict]) -> None:
        state = dict(state)
        self.history = [tuple(h) for h in state.pop(HISTORY_KEY, {}).get("history", [])]
        self.bandit.load_state_dict(state)
        if len(self.history) >= 3:
            self.refit()
