"""An update's statistics: what the loss returns for each micro-batch (``Stat``), combined over an optimizer update's
micro-batches and the ranks (``StatTotals``), then over the step's updates (``over_updates``)."""

from __future__ import annotations

import torch

from dapo.runtime import parallel

# dapo.algorithm.losses.Stat (value, weight, how): the loss brings its statistics, and this module imports no algorithm
Stat = tuple[torch.Tensor, torch.Tensor, str]


class StatTotals:
    """One optimizer update's statistics (``dapo.algorithm.losses.Stat``), combined on the device over its
    micro-batches, then over the ranks in one collective: a "mean" weighted by its weights (0 where they add up to 0), a
    "sum" added, a "max" the largest, a "min" the smallest of those with a weight (0 where none has)."""

    def __init__(self) -> None:
        self.totals: dict[str, Stat] = {}  # value: the sum of value x weight ("mean"), the sum, or the max

    def add(self, stats: dict[str, Stat]) -> None:
        for name, (value, weight, how) in stats.items():
            if how == "mean":
                value = value * weight
            elif how == "min":
                value = torch.where(weight > 0, value, torch.full_like(value, float("inf")))
            if (t := self.totals.get(name)) is None:
                self.totals[name] = (value, weight, how)
            else:
                combine = {"max": torch.maximum, "min": torch.minimum}.get(how, torch.add)
                self.totals[name] = (combine(t[0], value), t[1] + weight, how)

    def reduce(self, dist: parallel.Dist) -> dict[str, tuple[torch.Tensor, str]]:
        """Each statistic's value over every rank (whose losses return the same names), on the CPU, and its how."""
        if not self.totals:  # a mini-batch whose rows were all filtered out trained on nothing
            return {}
        names, hows = list(self.totals), [how for _, _, how in self.totals.values()]
        local = torch.stack([torch.stack([v.float(), w.float()]) for v, w, _ in self.totals.values()])  # (K, 2)
        per_rank = parallel.all_gather(local, dist).cpu()  # (ranks, K, 2)
        is_ = {h: torch.tensor([how == h for how in hows]) for h in ("mean", "max", "min")}  # (K,) each
        value = torch.where(is_["max"], per_rank[..., 0].amax(0), per_rank[..., 0].sum(0))  # (K,)
        value = torch.where(is_["min"], per_rank[..., 0].amin(0), value)
        weight = per_rank[..., 1].sum(0)  # (K,)
        value = torch.where(is_["mean"], value / weight.clamp(min=1e-30), value)
        value = torch.where((is_["mean"] | is_["min"]) & (weight <= 0), torch.zeros(()), value)
        return {k: (v, h) for k, v, h in zip(names, value.unbind(), hows)}


def over_updates(per_update: list[dict[str, tuple[torch.Tensor, str]]]) -> dict[str, torch.Tensor]:
    """The step's statistics: each one's mean over the optimizer updates that have it ("max", "min": their
    largest, smallest)."""
    hows = {k: how for stats in per_update for k, (_, how) in stats.items()}
    values = {k: torch.stack([stats[k][0] for stats in per_update if k in stats]) for k in hows}
    reduce = {"max": torch.amax, "min": torch.amin}
    return {k: reduce.get(hows[k], torch.mean)(v) for k, v in values.items()}
