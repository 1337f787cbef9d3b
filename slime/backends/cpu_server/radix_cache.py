"""A prefix cache over KV pool rows: SGLang's radix cache with page size 1.

Requests leave their computed tokens' rows here (a prompt's once prefilled, the rest when the request finishes); a later
request whose tokens start the same way points its first positions at those rows and prefills only the rest (a
multi-turn agent's next turn prefills its new turn, not its whole history). Each edge holds a run of tokens and the
pool row of each.

The cache is one holder of its rows among others (the scheduler counts holders per row): a request that matched a
prefix holds those rows too, so eviction only ever takes leaves whose rows no request holds, in the order of SGLang's
--radix-eviction-policy: least recently used first (lru), least often inserted through (lfu), or lru among those
inserted through fewer than `protected_threshold` times before the others (slru).
"""

import functools
import heapq
import itertools

# SGLang's eviction strategies (mem_cache/evict_policy.py): policy -> (a leaf's priority, the lowest evicted first;
# the parameters --radix-eviction-policy-config may set, with their defaults). `hits` counts the requests that
# inserted through a node, as SGLang's hit_count does.
_POLICIES = {
    "lru": (lambda node: node.used, {}),
    "lfu": (lambda node: (node.hits, node.used), {}),
    "slru": (
        lambda node, protected_threshold: (node.hits >= protected_threshold, node.used),
        {"protected_threshold": 2},
    ),
}


def eviction_order(policy: str = "lru", config: dict | None = None):
    """--radix-eviction-policy's priority function, with --radix-eviction-policy-config's parameters; a ValueError
    naming the policy or key at fault."""
    if policy not in _POLICIES:
        raise ValueError(f"--radix-eviction-policy {policy!r}: slime's CPU server evicts by {', '.join(_POLICIES)}")
    priority, params = _POLICIES[policy]
    if not isinstance(config or {}, dict):
        raise ValueError(f"--radix-eviction-policy-config must be a JSON object, not {config!r}")
    for key, value in (config or {}).items():
        if key not in params:
            raise ValueError(f"--radix-eviction-policy-config: {key!r} is no parameter of eviction policy {policy!r}")
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"--radix-eviction-policy-config: {key!r} must be an integer, not {value!r}")
    return functools.partial(priority, **{**params, **(config or {})})


class _Node:
    __slots__ = ("children", "parent", "key", "rows", "used", "hits")

    def __init__(self, parent=None, key=(), rows=()):
        self.children: dict = {}  # first token -> child
        self.parent, self.key, self.rows = parent, tuple(key), list(rows)
        self.used = self.hits = 0


def _common(a, b) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class RadixCache:
    def __init__(self, order=None):
        self.order = order or eviction_order()  # eviction_order(policy, config)
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
            if n < len(child.key):  # as SGLang: the matched part becomes a node, so the rest can be evicted alone
                self._split(child, n)
                rows += node.children[tokens[i]].rows
                break
            rows += child.rows
            node, i = child, i + n
        return rows

    def insert(self, tokens, rows, inserted: int = 0) -> int:
        """Cache rows[i] as the K/V of tokens[: i + 1]; `inserted`: how many of them the same request inserted before
        (those nodes are not counted as hit again, as SGLang's inserted_len). Returns how many leading tokens the cache
        already held (with rows of its own, which it keeps): rows[that:] are now held by the cache too."""
        node, i, now = self.root, 0, next(self.clock)
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                node.children[tokens[i]] = leaf = _Node(node, tokens[i:], rows[i:])
                leaf.used, leaf.hits = now, 1
                self.num_rows += len(leaf.rows)
                return i
            n = _common(child.key, tokens[i:])
            child.used = now
            if n < len(child.key):
                self._split(child, n)
            node, i = node.children[tokens[i]], i + n
            node.hits += i > inserted
        return i

    def _split(self, child, n):
        """child's first n tokens become a node of their own, with child below it."""
        head = _Node(child.parent, child.key[:n], child.rows[:n])
        head.used, head.hits = child.used, child.hits
        child.parent.children[child.key[0]] = head
        child.key, child.rows, child.parent = child.key[n:], child.rows[n:], head
        head.children[child.key[0]] = child

    def evict(self, want: int, held) -> list:
        """Drop leaves whose rows no one else holds (held(row) is False), lowest eviction priority first, until `want`
        rows are dropped or none is left; returns the dropped rows (the cache's holds on them, now the caller's to
        release)."""
        leaves = [(self.order(n), id(n), n) for n in self._nodes() if not n.children and not any(map(held, n.rows))]
        heapq.heapify(leaves)
        out = []
        while leaves and len(out) < want:
            _, _, node = heapq.heappop(leaves)
            out += node.rows
            parent = node.parent
            del parent.children[node.key[0]]
            if parent is not self.root and not parent.children and not any(map(held, parent.rows)):
                heapq.heappush(leaves, (self.order(parent), id(parent), parent))
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
