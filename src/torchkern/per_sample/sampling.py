"""Poisson sampling for DP-SGD: every step's batch takes each example independently with probability q.

This is the sampling the privacy analysis of DP-SGD assumes (``accounting``); its batch size varies from step to
step (binomial, mean q N) and may be 0. Average the clipped sum over the expected batch size q N, not the
realized one (the realized size depends on every example's membership: dividing by it is not covered by the
analysis): ``clip_and_accumulate(..., batch_size=loader.expected_batch_size)``. With ``cuda_graph=True``, pass
``max_batch_size`` too, so that a few captures (buckets of sizes) serve every batch size up to it.
"""

from __future__ import annotations

import secrets

import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data._utils.collate import default_collate
from torch.utils._pytree import tree_map

from .arguments import fail, integer, real


class PoissonSampler(Sampler[list[int]]):
    """Batches of indices into ``num_samples`` examples, each index in a batch with probability ``sample_rate``
    independently of the others and of other batches (a batch sampler: DataLoader's ``batch_sampler``). One epoch is
    ``steps`` batches, ``round(1 / sample_rate)`` by default (an expected pass over the data). ``generator``: the
    source of the draws (CPU); by default a generator seeded once from ``secrets`` (the OS's cryptographic source)."""

    def __init__(self, num_samples: int, sample_rate: float, steps: int | None = None,
                 generator: torch.Generator | None = None):
        self.num_samples = integer("num_samples", num_samples, 1)
        self.sample_rate = real("sample_rate", sample_rate, 0.0, 1.0)
        self.steps = integer("steps", max(1, round(1 / self.sample_rate)) if steps is None else steps, 1)
        if generator is not None and not isinstance(generator, torch.Generator):
            fail(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        self.generator = generator if generator is not None else \
            torch.Generator().manual_seed(secrets.randbits(64))

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        for _ in range(self.steps):
            chosen = torch.rand(self.num_samples, generator=self.generator) < self.sample_rate
            yield chosen.nonzero().flatten().tolist()


class _EmptyAware:
    """A collate function that turns an empty batch into the collated layout of one example with 0 rows (the
    default collate cannot collate nothing)."""

    def __init__(self, dataset: Dataset, collate):
        self.dataset, self.collate = dataset, collate

    def __call__(self, batch: list):
        if batch:
            return self.collate(batch)
        return tree_map(lambda t: t[:0] if isinstance(t, torch.Tensor) else t, self.collate([self.dataset[0]]))


class PoissonLoader(DataLoader):
    """A DataLoader whose batches are Poisson samples of ``dataset`` (:class:`PoissonSampler`): variable size,
    empty ones as tensors with 0 rows. ``sample_rate`` (q), ``expected_batch_size`` (q N, the divisor for
    ``clip_and_accumulate``'s ``batch_size``) and the sampler's ``steps`` per epoch; other keyword arguments go to
    DataLoader (``num_workers``, ``pin_memory``, ``collate_fn``, ...; not ``batch_size``, ``shuffle``,
    ``sampler``, ``batch_sampler`` or ``drop_last``, which the sampling fixes)."""

    def __init__(self, dataset: Dataset, sample_rate: float, *, steps: int | None = None,
                 generator: torch.Generator | None = None, collate_fn=None, **kwargs):
        fixed = sorted({"batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"} & set(kwargs))
        if fixed:
            fail(f"PoissonLoader draws its own batches; {', '.join(fixed)} cannot be given")
        sampler = PoissonSampler(len(dataset), sample_rate, steps, generator)
        super().__init__(dataset, batch_sampler=sampler,
                         collate_fn=_EmptyAware(dataset, collate_fn or default_collate), **kwargs)
        self.sample_rate = sampler.sample_rate
        self.expected_batch_size = sampler.sample_rate * len(dataset)
