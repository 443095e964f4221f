"""Tensor-parallel vocabulary shards simulated in one process: one thread per rank,
each running the same code on its own columns, exchanging through an in-memory
all-gather (the collective vLLM's TP group provides between processes)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from vllm_dllm.decoding.vocab import VocabShard


class Exchange:
    """An all-gather among `world` threads that also counts what crosses ranks."""

    def __init__(self, world: int):
        self.world = world
        self.barrier = threading.Barrier(world)
        self.slots: list[torch.Tensor | None] = [None] * world
        self.calls = 0
        self.elements = 0  # numbers each rank sent, summed over calls (rank 0's count)

    def gather_for(self, rank: int):
        def gather(t: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = t.clone()
            self.barrier.wait()
            stacked = torch.stack(self.slots)
            if rank == 0:
                self.calls += 1
                self.elements += t.numel()
            self.barrier.wait()  # nobody overwrites a slot before all have read
            return stacked

        return gather


def bounds(vocab: int, world: int) -> list[tuple[int, int]]:
    """vLLM's split: equal shards of the vocabulary padded to a multiple of world
    (here without the padding to 64), the last one shorter."""
    per = -(-vocab // world)
    return [(r * per, min((r + 1) * per, vocab)) for r in range(world)]


def run_sharded(fn: Callable[[VocabShard, int, int], object], vocab: int, world: int,
                exchange: Exchange | None = None) -> list:
    """fn(shard, start, end) on every rank at once; the ranks' results in rank order."""
    exchange = exchange or Exchange(world)
    results: list = [None] * world
    errors: list[BaseException] = []

    def rank_main(rank: int, start: int, end: int) -> None:
        try:
            results[rank] = fn(VocabShard(start, end, vocab, rank, exchange.gather_for(rank)), start, end)
        except BaseException as error:  # surfaced in the caller
            errors.append(error)
            exchange.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r, s, e)) for r, (s, e) in enumerate(bounds(vocab, world))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results
