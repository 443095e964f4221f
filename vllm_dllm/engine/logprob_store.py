"""Per-position logprob rows of the requests that asked for logprobs.

A token is committed at one step and streamed at a later one (once everything to its
left is final, or when its block ends under token editing), and editing may rewrite
it meanwhile: so each committed position keeps the logprob row of the step that last
wrote it, and rows leave with the tokens they belong to.  Only requests that ask hold
a row of the store (rows grow by doubling); row 0 is a sink the step writes the
other requests' candidates into, so recording stays one batched write.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_dllm.decoding.logprobs import CandidateLogprobs


class LogprobStore:
    def __init__(self, capacity: int, max_gen: int, max_logprobs: int, device: torch.device):
        self.max_gen = max_gen
        self.width = max_logprobs + 1
        self.device = device
        self.row_of = np.zeros(capacity, dtype=np.int64)  # per request slot; 0: no logprobs
        self.num_logprobs = np.zeros(capacity, dtype=np.int64)
        self._free: list[int] = []
        self._rows = 1
        self.ids = torch.zeros(0, max_gen, self.width, dtype=torch.long, device=device)
        self.values = torch.zeros(0, max_gen, self.width, dtype=torch.float32, device=device)
        self.rank = torch.zeros(0, max_gen, dtype=torch.long, device=device)
        self._allocate(2)

    def _allocate(self, rows: int) -> None:
        old = self.ids.shape[0]
        shape = (rows, self.max_gen, self.width)
        for name, dtype in (("ids", torch.long), ("values", torch.float32)):
            grown = torch.zeros(shape, dtype=dtype, device=self.device)
            grown[:old] = getattr(self, name)
            setattr(self, name, grown)
        rank = torch.zeros(shape[:2], dtype=torch.long, device=self.device)
        rank[:old] = self.rank
        self.rank = rank

    def grow_slots(self, capacity: int) -> None:
        for name in ("row_of", "num_logprobs"):
            old = getattr(self, name)
            grown = np.zeros(capacity, dtype=old.dtype)
            grown[: len(old)] = old
            setattr(self, name, grown)

    def admit(self, slot: int, num_logprobs: int | None) -> None:
        if num_logprobs is None:
            self.row_of[slot] = 0
            return
        if not 0 <= num_logprobs < self.width:
            raise ValueError(f"logprobs must be between 0 and {self.width - 1}, got {num_logprobs}")
        if not self._free:
            if self._rows == self.ids.shape[0]:
                self._allocate(2 * self._rows)
            self._free.append(self._rows)
            self._rows += 1
        self.row_of[slot] = self._free.pop()
        self.num_logprobs[slot] = num_logprobs

    def release(self, slot: int) -> None:
        if self.row_of[slot]:
            self._free.append(int(self.row_of[slot]))
            self.row_of[slot] = 0

    def step_width(self, slots_host: np.ndarray) -> int | None:
        """Top entries this step needs (the most any of its requests asked), None if
        none of them asked: host arrays only, no device sync."""
        asking = self.row_of[slots_host] > 0
        return int(self.num_logprobs[slots_host][asking].max()) if asking.any() else None

    def record(self, slots_host: np.ndarray, rows: torch.Tensor, positions: torch.Tensor,
               written: torch.Tensor, candidates: CandidateLogprobs) -> None:
        """Keep the rows of the candidates the step wrote into their canvas
        (`written`, per candidate; candidate i is request rows[i], position
        positions[i])."""
        store_rows = torch.as_tensor(self.row_of[slots_host], device=self.device)[rows]
        width = candidates.ids.shape[1]
        keep = written[:, None]
        self.ids[store_rows, positions, :width] = torch.where(keep, candidates.ids, self.ids[store_rows, positions, :width])
        self.values[store_rows, positions, :width] = torch.where(
            keep, candidates.values, self.values[store_rows, positions, :width])
        self.rank[store_rows, positions] = torch.where(written, candidates.rank, self.rank[store_rows, positions])

    def record_forced(self, slots_host: np.ndarray, positions: np.ndarray, tokens: np.ndarray) -> None:
        """Rows of tokens a grammar forced (jump-forward): the only token its
        constrained distribution allows, so log-probability 0 and rank 1, first of
        the top entries; every other token has probability 0 (the lowest ids stand
        for them, at -inf, as a masked row's top entries are)."""
        store_rows = self.row_of[slots_host]
        asking = store_rows > 0
        if not asking.any():
            return
        index = torch.as_tensor(np.stack([store_rows[asking], positions[asking]]), device=self.device)
        token = torch.as_tensor(tokens[asking], device=self.device)[:, None]
        others = torch.arange(max(self.width - 2, 0), device=self.device).expand(len(token), -1)
        others = others + (others >= token).long()
        self.ids[index[0], index[1]] = torch.cat([token, token, others], dim=1)[:, : self.width]
        values = torch.full((len(token), self.width), float("-inf"), device=self.device)
        values[:, :2] = 0.0
        self.values[index[0], index[1]] = values
        self.rank[index[0], index[1]] = 1

    def take(self, slots_host: np.ndarray, starts: np.ndarray, ends: np.ndarray):
        """Rows of positions [start, end) of each request (all of them asking), in
        order, as numpy (token ids, logprobs, ranks), in one device-to-host copy."""
        counts = ends - starts
        total = int(counts.sum())
        offsets = np.repeat(starts - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
        positions = np.arange(total) + offsets
        rows = np.repeat(self.row_of[slots_host], counts)
        index = torch.as_tensor(np.stack([rows, positions]), device=self.device)
        # Token ids and ranks are exact in float64: one copy for the three.
        packed = torch.cat([self.ids[index[0], index[1]].double(), self.values[index[0], index[1]].double(),
                            self.rank[index[0], index[1], None].double()], dim=1).cpu().numpy()
        width = self.width
        return (packed[:, :width].astype(np.int64), packed[:, width : 2 * width].astype(np.float32),
                packed[:, 2 * width].astype(np.int64))
