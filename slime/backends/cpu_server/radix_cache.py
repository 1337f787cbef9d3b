"""A prefix cache over KV pool rows: SGLang's radix cache with page size 1.

Requests leave their computed tokens' rows here (a prompt's once prefilled, the rest when the request finishes); a later
request whose tokens start the same way points its first positions at those rows and prefills only the rest (a
multi-turn agent's next turn prefills its new turn, not its whole history). Each edge holds a run of tokens and the
pool row of each.

The cache is one holder of its rows among others (the scheduler counts holders per row): a request that matched a
prefix holds those rows too, so eviction only ever takes leaves whose rows no request holds, least recently used first.
"""

import heapq
import itertools


class _Node:
    __slots__ = ("children", "parent", "key", "rows", "used")

    def __init__(self, parent=None, key=(), rows=()):
        self.children: dict = {}  # first token -> child
        self.parent, self.key, self.rows = parent, tuple(key), list(rows)
        self.used = 0


def _common(a, b) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class RadixCache:
    def __init__(self):
        self.root = _Node()
        self.clock = itertools.count(1)  # a request's touch: eviction takes the least recent first
        self.num_rows = 0

    def match(self, tokens, limit: int) -> list:
        """Rows of the longest cached prefix of tokens[:limit] (touched as used)."""
        node, rows, i, now = self.root, [], 0, next(self.clock)
        while i < limit:
            child = node.children.get(tokens[i])
            if child is None:
                break
            n = _common(child.key, tokens[i:limit])
            child.used = now
            rows += child.rows[:n]
            if n < len(child.key):
                break
            node, i = child, i + n
        return rows

    def insert(self, tokens, rows) -> int:
        """Cache rows[i] as the K/V of tokens[: i + 1]. Returns how many leading tokens the cache already held (with
        rows of its own, which it keeps): rows[that:] are now held by the cache too."""
        node, i, now = self.root, 0, next(self.clock)
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                node.children[tokens[i]] = leaf = _Node(node, tokens[i:], rows[i:])
                leaf.used = now
                self.num_rows += len(leaf.rows)
                return i
            n = _common(child.key, tokens[i:])
            child.used = now
            if n < len(child.key):
                self._split(child, n)
            node, i = node.children[tokens[i]], i + n
        return i

    def _split(self, child, n):
        """child's first n tokens become a node of their own, with child below it."""
        head = _Node(child.parent, child.key[:n], child.rows[:n])
        head.used = child.used
        child.parent.children[child.key[0]] = head
        child.key, child.rows, child.parent = child.key[n:], child.rows[n:], head
        head.children[child.key[0]] = child

    def evict(self, want: int, held) -> list:
        """Drop least recently used leaves whose rows no one else holds (held(row) is False) until `want` rows are
        dropped or none is left; returns the dropped rows (the cache's holds on them, now the caller's to release)."""
        leaves = [(n.used, id(n), n) for n in self._nodes() if not n.children and not any(map(held, n.rows))]
        heapq.heapify(leaves)
        out = []
        while leaves and len(out) < want:
            _, _, node = heapq.heappop(leaves)
            out += node.rows
            parent = node.parent
            del parent.children[node.key[0]]
            if parent is not self.root and not parent.children and not any(map(held, parent.rows)):
                heapq.heappush(leaves, (parent.used, id(parent), parent))
        self.num_rows -= len(out)
        return out

    def reset(self) -> list:
        """Forget everything; returns every row the cache held."""
        out = [x for n in self._nodes() for x in n.rows]
        self.root, self.num_rows = _Node(), 0
        return out

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node
