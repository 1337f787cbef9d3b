"""Balanced partitioning of sequence lengths (Karmarkar-Karp / largest differencing method).

Used to split a rollout across DP ranks (`--balance-data`, whole groups) and a training step into micro-batches
(`--use-dynamic-batch-size`) so every partition carries about the same number of tokens. Same algorithm as verl's
`get_seqlen_balanced_partitions`: keep a heap of partial k-way solutions, repeatedly merge the two with the largest
spread, pairing the biggest subset of one with the smallest of the other.
"""

import heapq
import itertools


class _PartialSolution:
    """k subsets (each `[sum, [indices]]`) kept sorted by sum, largest first."""

    def __init__(self, subsets):
        self.subsets = sorted(subsets, key=lambda s: (s[0], len(s[1])), reverse=True)

    @property
    def spread(self):
        return self.subsets[0][0] - self.subsets[-1][0]

    def merge(self, other):
        # largest of self with smallest of other, and so on: this is what shrinks the spread
        merged = [[a[0] + b[0], a[1] + b[1]] for a, b in zip(self.subsets, reversed(other.subsets))]
        return _PartialSolution(merged)


def karmarkar_karp(seqlen_list, k_partitions, equal_size):
    """Index lists of `k_partitions` subsets of `seqlen_list` with nearly equal sums.

    With `equal_size` every subset gets exactly `len(seqlen_list) // k_partitions` items: items are seeded k at a time
    in sorted order so each merge adds one item to every subset.
    """
    order = sorted(range(len(seqlen_list)), key=lambda i: (seqlen_list[i], i))
    if equal_size:
        seeds = [order[i : i + k_partitions] for i in range(0, len(order), k_partitions)]
    else:
        seeds = [[i] for i in order]

    counter = itertools.count()  # deterministic tie-breaking; heap pops the largest spread first
    heap = []
    for seed in seeds:
        subsets = [[seqlen_list[i], [i]] for i in seed] + [[0, []] for _ in range(k_partitions - len(seed))]
        sol = _PartialSolution(subsets)
        heapq.heappush(heap, (-sol.spread, next(counter), sol))
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = a.merge(b)
        heapq.heappush(heap, (-merged.spread, next(counter), merged))
    return [indices for _, indices in heap[0][2].subsets]


def get_seqlen_balanced_partitions(seqlen_list, k_partitions, equal_size):
    """Split indices of `seqlen_list` into `k_partitions` non-empty, sorted index lists with balanced length sums.

    `equal_size=True` additionally requires the same number of items per partition (needs `len % k == 0`).
    """
    n = len(seqlen_list)
    if k_partitions < 1 or n < k_partitions:
        raise ValueError(f"cannot split {n} sequences into {k_partitions} non-empty partitions")
    if equal_size and n % k_partitions != 0:
        raise ValueError(
            f"equal_size partitioning needs the number of sequences ({n}) to be a multiple of {k_partitions}"
        )
    partitions = [sorted(p) for p in karmarkar_karp(seqlen_list, k_partitions, equal_size)]
    assert sorted(itertools.chain.from_iterable(partitions)) == list(range(n)) and all(partitions)
    return partitions
