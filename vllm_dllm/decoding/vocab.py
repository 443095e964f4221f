"""The vocabulary as the decoding rules see it: whole on one device, or one
contiguous shard per tensor-parallel rank.

Every vocabulary-wide operation a rule, the logprobs or a filter needs goes through
a `Vocab`: the max and its token, softmax, a row's value at a token, sums, top-k,
the inverse-CDF draw, the top-p cut.  `Vocab` is the whole vocabulary and is exactly
the torch code the rules were written with.  `VocabShard` holds columns
[start, end) of it: each operation reduces its own columns to a few numbers per
row, one all-gather exchanges them, and every rank combines them the same way, so
all ranks reach the same tokens without a [rows, vocab] tensor ever crossing ranks.
Ranks hold ascending ranges in rank order, so "the first id" among equals is the
first rank's.  Only host-known facts (row counts, `k_max`) decide which gathers
run: every rank calls the same sequence.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# gather(t [rows, k]) -> [world, rows, k]: every rank's t, in rank order.
Gather = Callable[[torch.Tensor], torch.Tensor]

# Rounds of the top-p threshold search, each cutting the interval into 16: 16**14 =
# 2**56 of at most 800 (logit units): logits within 1e-14 of each other may fall on
# either side of the cut, as ties do (their probabilities differ by 1e-14 relative).
_TOP_P_ROUNDS = 14
_TOP_P_POINTS = 15
# exp(-800) underflows float64: logits this far below a row's max carry no mass.
_NEGLIGIBLE = 800.0


class Vocab:
    """The whole vocabulary, on this device."""

    start = 0

    def columns(self, x: torch.Tensor) -> torch.Tensor:
        """The token id of each column of `x`."""
        return torch.arange(x.shape[-1], device=x.device)

    def size(self, x: torch.Tensor) -> int:
        return x.shape[-1]

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            # torch's CPU argmax is a scalar loop: 3-4x slower than max(dim) (2304
            # columns) and 40 ms for 256 rows of LLaDA-8B's 126,464 here.  max(dim)'s
            # indices are argmax's: the first maximum, NaN counting as the maximum.
            return x.max(dim=-1).indices
        return x.argmax(dim=-1)

    def max(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.max(dim=-1)

    def softmax(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, dim=-1)

    def log_softmax(self, x: torch.Tensor) -> torch.Tensor:
        return x.log_softmax(dim=-1)

    def at(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x[i, ids[i]] per row."""
        return x.gather(1, ids[:, None]).squeeze(1)

    def fill_column(self, x: torch.Tensor, token: int, rows: torch.Tensor | None, value: float) -> None:
        """x[i, token] = value where rows[i] (every row: None), in place."""
        x[:, token] = value if rows is None else torch.where(rows, value, x[:, token])

    def scatter_add(self, x: torch.Tensor, ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """x with values[i, j] added at x[i, ids[i, j]] (ids >= 0)."""
        return x.scatter_add(1, ids.clamp(min=0), (values * (ids >= 0)).to(x.dtype))

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(dim=-1)

    def sum_over_ranks(self, x: torch.Tensor) -> torch.Tensor:
        """Each rank's partial [rows, k] over its columns, summed over the ranks."""
        return x

    def topk(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return x.topk(k, dim=-1)

    def kth_largest(self, x: torch.Tensor, k: torch.Tensor, k_max: int) -> torch.Tensor:
        """The k[i]-th largest value of each row (1 <= k <= k_max, host-known k_max)."""
        return x.topk(k_max, dim=-1).values.gather(1, (k - 1)[:, None])

    def top_p_removed(self, x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        """bool per entry: outside the smallest set of most likely tokens (under
        softmax(x)) whose mass reaches top_p; the token crossing top_p is kept."""
        ordered, order = torch.sort(x, dim=-1, descending=True)
        cumulative = torch.cumsum(torch.softmax(ordered, dim=-1), dim=-1)
        remove = cumulative > top_p[:, None]
        remove = torch.cat([torch.zeros_like(remove[:, :1]), remove[:, :-1]], dim=1)
        return torch.empty_like(remove).scatter_(1, order, remove)

    def inverse_cdf(self, probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Per row, the smallest id whose float64 cumulative probability exceeds u * total."""
        cdf = torch.cumsum(probs.double(), dim=-1)
        drawn = torch.searchsorted(cdf, (u.double() * cdf[:, -1])[:, None], right=True).squeeze(1)
        return drawn.clamp(max=probs.shape[-1] - 1)


WHOLE = Vocab()


class VocabShard(Vocab):
    """Token ids [start, end) of a vocabulary of `vocab_size`, on rank `rank` of the
    ranks that `gather` exchanges with."""

    def __init__(self, start: int, end: int, vocab_size: int, rank: int, gather: Gather):
        if not 0 <= start < end <= vocab_size:
            raise ValueError(f"vocabulary shard [{start}, {end}) does not lie in a vocabulary of {vocab_size}")
        self.start, self.end, self.vocab_size, self.rank = start, end, vocab_size, rank
        self.gather = gather

    def columns(self, x: torch.Tensor) -> torch.Tensor:
        return torch.arange(self.start, self.start + x.shape[-1], device=x.device)

    def size(self, x: torch.Tensor) -> int:
        return self.vocab_size

    def _gathered(self, *columns: torch.Tensor) -> torch.Tensor:
        """[world, rows, len(columns)] float64: each rank's per-row numbers."""
        return self.gather(torch.stack([c.double() for c in columns], dim=-1))

    def max(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values, local = x.max(dim=-1)
        both = self._gathered(values, local + self.start)
        best = both[..., 0].max(dim=0).values
        # The first rank holding the best value has its lowest id (ranks ascend).
        first = (both[..., 0] == best).int().argmax(dim=0)
        ids = both[..., 1].gather(0, first[None]).squeeze(0)
        return best.to(x.dtype), ids.long()

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        return self.max(x)[1]

    def logsumexp(self, x: torch.Tensor) -> torch.Tensor:
        """float64 log(sum(exp(x))) over the whole vocabulary, per row."""
        top = x.max(dim=-1).values.double()
        local = torch.exp(x.double() - torch.where(torch.isfinite(top), top, 0.0)[:, None]).sum(dim=-1)
        # A shard whose columns are all -inf (a grammar, top-k) sends -inf as its max
        # and weighs nothing, however far below 0 the other shards' maxima lie.
        both = self._gathered(top, local)
        peak = both[..., 0].max(dim=0).values
        shift = torch.where(torch.isfinite(peak), peak, 0.0)
        total = (both[..., 1] * torch.exp(both[..., 0] - shift)).sum(dim=0)
        return shift + torch.log(total)

    def softmax(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x.double() - self.logsumexp(x)[:, None]).to(x.dtype)

    def log_softmax(self, x: torch.Tensor) -> torch.Tensor:
        return (x.double() - self.logsumexp(x)[:, None]).to(x.dtype)

    def _owned(self, ids: torch.Tensor) -> torch.Tensor:
        return (ids >= self.start) & (ids < self.end)

    def at(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        owned = self._owned(ids)
        local = x.gather(1, (ids - self.start).clamp(0, x.shape[1] - 1)[:, None]).squeeze(1)
        both = self._gathered(torch.where(owned, local, 0), owned)
        owner = both[..., 1].argmax(dim=0)
        return both[..., 0].gather(0, owner[None]).squeeze(0).to(x.dtype)

    def fill_column(self, x: torch.Tensor, token: int, rows: torch.Tensor | None, value: float) -> None:
        if self.start <= token < self.end:
            super().fill_column(x, token - self.start, rows, value)

    def scatter_add(self, x: torch.Tensor, ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        owned = self._owned(ids)
        local = (ids - self.start).clamp(0, x.shape[1] - 1)
        return x.scatter_add(1, local, (values * owned).to(x.dtype))

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        return self._gathered(x.sum(dim=-1))[..., 0].sum(dim=0).to(x.dtype)

    def sum_over_ranks(self, x: torch.Tensor) -> torch.Tensor:
        # Summed in rank order on every rank: all ranks hold the same bits.
        return self.gather(x.float()).sum(dim=0).to(x.dtype)

    def topk(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = x.shape[0]
        local = min(k, x.shape[1])
        values, ids = x.topk(local, dim=-1)
        if local < k:  # this shard is narrower than k: pad with entries that lose
            values = torch.cat([values, values.new_full((rows, k - local), float("-inf"))], dim=1)
            ids = torch.cat([ids, ids.new_full((rows, k - local), -self.start - 1)], dim=1)
        both = self.gather(torch.cat([values.double(), (ids + self.start).double()], dim=1))
        merged_values = both[..., :k].permute(1, 0, 2).reshape(rows, -1)
        merged_ids = both[..., k:].permute(1, 0, 2).reshape(rows, -1)
        # Padding loses every tie, even with a real token at -inf: real entries first,
        # then a stable sort by value.
        real_first = torch.argsort((merged_ids < 0).int(), dim=1, stable=True)
        merged_values, merged_ids = merged_values.gather(1, real_first), merged_ids.gather(1, real_first)
        best, where = torch.sort(merged_values, dim=1, descending=True, stable=True)
        return best[:, :k].to(x.dtype), merged_ids.gather(1, where[:, :k]).long()

    def kth_largest(self, x: torch.Tensor, k: torch.Tensor, k_max: int) -> torch.Tensor:
        values, _ = self.topk(x, k_max)
        return values.gather(1, (k - 1)[:, None])

    def top_p_removed(self, x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        """The cut is the smallest value v whose strictly-more-likely mass is <= top_p
        (the entries below v go).  Searched in value space: each round every rank
        gives its mass above `_TOP_P_POINTS` thresholds per row, one gather sums them."""
        rows = x.shape[0]
        probs = torch.exp(x.double() - self.logsumexp(x)[:, None])
        ascending, order = torch.sort(x.double(), dim=-1)
        # mass[i] = the shard's mass at sorted index >= i, and 0 past the end.
        mass = torch.flip(torch.cumsum(torch.flip(probs.gather(1, order), [1]), dim=1), [1])
        mass = torch.cat([mass, mass.new_zeros(rows, 1)], dim=1)

        def mass_above(thresholds: torch.Tensor) -> torch.Tensor:
            local = mass.gather(1, torch.searchsorted(ascending, thresholds.contiguous(), right=True))
            return self.gather(local).sum(dim=0)

        finite = torch.isfinite(ascending)
        span = self._gathered(torch.where(finite, ascending, float("inf")).min(dim=1).values,
                              torch.where(finite, ascending, float("-inf")).max(dim=1).values)
        high = span[..., 1].max(dim=0).values
        # Below high - _NEGLIGIBLE a token's float64 probability is 0: no lower cut
        # changes the mass above it.
        lowest = span[..., 0].min(dim=0).values
        low = torch.maximum(torch.nextafter(lowest, torch.full_like(lowest, float("-inf"))), high - _NEGLIGIBLE)
        low, high = torch.where(torch.isfinite(high), low, 0.0), torch.where(torch.isfinite(high), high, 0.0)
        fractions = torch.arange(1, _TOP_P_POINTS + 1, dtype=torch.float64, device=x.device) / (_TOP_P_POINTS + 1)
        for _ in range(_TOP_P_ROUNDS):
            points = low[:, None] + (high - low)[:, None] * fractions
            within = mass_above(points) <= top_p[:, None].double()
            # mass_above falls as the threshold rises: the first point within is the
            # new high, the one before it the new low.
            first = within.int().argmax(dim=1)
            any_within = within.any(dim=1)
            new_high = torch.where(any_within, points.gather(1, first[:, None]).squeeze(1), high)
            new_low = torch.where(first > 0, points.gather(1, (first - 1).clamp(min=0)[:, None]).squeeze(1), low)
            low = torch.where(any_within, new_low, points[:, -1])
            high = new_high
        between = (ascending > low[:, None]) & (ascending <= high[:, None])
        smallest = torch.where(between, ascending, float("inf")).min(dim=1).values
        cut = self._gathered(smallest)[..., 0].min(dim=0).values
        return x.double() < cut[:, None]

    def inverse_cdf(self, probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        cdf = torch.cumsum(probs.double(), dim=-1)
        totals = self._gathered(cdf[:, -1])[..., 0]  # [world, rows]
        before = torch.cumsum(totals, dim=0) - totals
        target = u.double() * totals.sum(dim=0)
        # The rank whose range the target falls in draws; past the end (rounding),
        # the last rank's last id, as the whole-vocabulary clamp gives.
        holds = (before + totals > target) & (totals > 0)
        owner = torch.where(holds.any(dim=0), holds.int().argmax(dim=0), totals.shape[0] - 1)
        local = torch.searchsorted(cdf, (target - before[self.rank])[:, None], right=True).squeeze(1)
        drawn = self._gathered(local.clamp(max=probs.shape[-1] - 1) + self.start)[..., 0]
        return drawn.gather(0, owner[None]).squeeze(0).long()
