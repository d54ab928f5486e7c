"""Privacy accounting for DP-SGD: the (epsilon, delta) that a run of Poisson-sampled Gaussian steps spends, and the
noise multiplier that keeps a planned run within a target.

The analysis is Opacus's (``opacus.accountants``, the optional ``dp`` extra: ``pip install 'torchkern[dp]'``), not
written here: ``"rdp"`` (default) is Rényi DP of the sampled Gaussian mechanism (Mironov, Talwar and Zhang 2019)
converted to (epsilon, delta) as Balle et al. 2020 do; ``"prv"`` composes the privacy random variables numerically
(Gopi, Lee and Wutschitz 2021): tighter (about 8% lower epsilon in the DP-SGD paper's MNIST setting) and slower
(about a second per epsilon). Both assume what ``PoissonLoader`` and ``clip_and_accumulate`` do: each example in
a step's batch independently with probability ``sample_rate``, every per-sample gradient clipped to ``max_norm``,
Gaussian noise of standard deviation ``noise_multiplier * max_norm`` added once to their sum.
"""

from __future__ import annotations

import math
import warnings

from .arguments import fail, integer, real

MECHANISMS = ("rdp", "prv")


def _opacus(what: str):
    """Opacus's accountants module, or an ImportError naming the extra that installs it."""
    try:
        from opacus import accountants
    except ImportError as exc:
        raise ImportError(f"torchkern.per_sample.{what} needs Opacus's accountants, the optional 'dp' extra: "
                          "pip install 'torchkern[dp]'") from exc
    return accountants


def _mechanism(value: object) -> str:
    if value not in MECHANISMS:
        fail(f"mechanism must be one of {', '.join(map(repr, MECHANISMS))}, got {value!r}")
    return value


class PrivacyAccountant:
    """The privacy a DP-SGD run has spent so far. Call :meth:`step` once per optimizer step (or with ``steps=n``
    for n steps alike), then :meth:`epsilon`::

        accountant = PrivacyAccountant()
        for x, y in loader:  # a PoissonLoader
            clip_and_accumulate(model, loss_fn, x, y, max_norm, sigma, batch_size=loader.expected_batch_size)
            optimizer.step()
            accountant.step(sigma, loader.sample_rate)
        print(accountant.epsilon(delta=1e-5))

    ``history``: ``[(noise_multiplier, sample_rate, steps), ...]``, consecutive steps alike merged (Opacus's
    layout: ``accountant.history`` can be saved with a checkpoint and assigned back). ``mechanism``: "rdp" or
    "prv" (module docstring).
    """

    def __init__(self, mechanism: str = "rdp"):
        self.mechanism = _mechanism(mechanism)
        self.history: list[tuple[float, float, int]] = []

    def step(self, noise_multiplier: float, sample_rate: float, steps: int = 1) -> None:
        """Records ``steps`` steps of Gaussian noise ``noise_multiplier`` (sigma: noise std / max_norm) on batches
        drawn with probability ``sample_rate`` per example. A step without noise (sigma = 0) spends infinite
        epsilon."""
        sigma = real("noise_multiplier", noise_multiplier, 0.0, low_open=False)
        q = real("sample_rate", sample_rate, 0.0, 1.0)
        steps = integer("steps", steps, 1)
        if self.history and self.history[-1][:2] == (sigma, q):
            steps += self.history.pop()[2]
        self.history.append((sigma, q, steps))

    @property
    def steps(self) -> int:
        return sum(n for _, _, n in self.history)

    def epsilon(self, delta: float) -> float:
        """The epsilon of the (epsilon, delta)-DP guarantee of every step recorded so far; 0 before the first."""
        delta = real("delta", delta, 0.0, 1.0, high_open=True)
        if not self.history:
            return 0.0
        if any(sigma == 0 for sigma, _, _ in self.history):
            return math.inf
        accountant = _opacus("PrivacyAccountant").create_accountant(self.mechanism)
        accountant.history = list(self.history)
        return float(accountant.get_epsilon(delta=delta))


def noise_multiplier_for(target_epsilon: float, delta: float, sample_rate: float, steps: int,
                         mechanism: str = "rdp") -> float:
    """The noise multiplier sigma that makes ``steps`` steps at ``sample_rate`` spend at most ``target_epsilon``
    (for ``delta``), found by bisection on the accountant's epsilon: epsilon(sigma) lies within 1% below the
    target. Raises ValueError for a target no sigma up to Opacus's bound (10^6) reaches."""
    target = real("target_epsilon", target_epsilon, 0.0)
    delta = real("delta", delta, 0.0, 1.0, high_open=True)
    q = real("sample_rate", sample_rate, 0.0, 1.0)
    steps, mechanism = integer("steps", steps, 1), _mechanism(mechanism)
    utils = _opacus("noise_multiplier_for").utils
    try:
        with warnings.catch_warnings():  # the search's probes of large sigma hit the largest RDP order: no matter
            warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
            return float(utils.get_noise_multiplier(target_epsilon=target, target_delta=delta, sample_rate=q,
                                                    steps=steps, accountant=mechanism,
                                                    epsilon_tolerance=0.01 * target))
    except ValueError as exc:
        fail(f"no noise_multiplier reaches target_epsilon={target:g} (delta={delta:g}, sample_rate={q:g}, "
              f"steps={steps}): {exc}")
