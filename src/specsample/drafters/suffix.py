"""The `suffix` drafter: the most frequent continuation in a suffix tree, no second model.

After SuffixDecoding (Oliaro et al., 2024): one suffix tree, cut at `depth`,
counts every substring of up to `depth` tokens of the current request (prompt
and output so far) and of earlier requests of this process, so that answers
that repeat across requests (agents, templated tasks) are drafted too. To
propose, the drafter takes the longest suffix of the context (up to
`max_match` tokens) that occurred before with a continuation, then walks
down the most frequent child (ties: the most recent), while the walk's
empirical probability stays above `min_probability` and its length below
`growth` times the match length, so longer matches earn longer drafts.

Appending a token updates the nodes of the last `depth` suffixes: O(depth) per
token, independent of the amount of text; the tree is C++ (suffix_tree.cpp,
`NativeSuffixTree`) where it builds, 2.7 times as fast as the Python
`SuffixTree` it falls back to (1.8 against 5.0 us a token of Spec-Bench
prompts, benchmarks/suffix_tree.py). The emitted tokens are counted when the
drafter is next asked for a draft (or its request ends), several at a time:
while the K policy leaves it unasked (K = 0), a step costs what plain
decoding's does, where counting each token just after a target pass, with the
CPU's caches cold, cost about 20 us a step. Memory is bounded by keeping at
most `history_tokens` tokens of earlier requests; the oldest requests are
evicted by subtracting their counts.

The proposal is a point mass (no probabilities), verified exactly at any temperature.
"""

from __future__ import annotations

import ctypes
import heapq
import os
from collections import deque
from collections.abc import Sequence
from functools import cache
from importlib import resources

import numpy as np
from torch import Tensor

from specsample.drafters.base import Draft
from specsample.drafters.ngram import LookupDrafter
from specsample.sampling import RandomSource, SamplingParams


def checked_depth(depth: int) -> int:
    """A suffix tree's depth, at least 2 (ValueError otherwise)."""
    if depth < 2:
        raise ValueError(f"depth must be >= 2, got {depth}")
    return depth


class SuffixTree:
    """Occurrence counts of every substring of at most `depth` tokens of some token sequences.

    A node is an integer: node 0 is the root, `children[node]` maps a token to the child that
    spells the node's substring followed by it, `count[node]` counts the substring's occurrences
    and `last[node]` is the clock of its most recent one. Integers in lists and dicts of integers
    are nothing the garbage collector tracks, where a tree of node objects held hundreds of
    thousands that each full collection walked (about 50 ms, inside some request). Nodes whose
    count drops to 0 are unlinked and reused.

    A sequence is appended token by token through its `active` list: the nodes of its suffixes
    ending at the last token, shortest first (active[i] spells the last i + 1 tokens).
    """

    def __init__(self, depth: int) -> None:
        self.depth = checked_depth(depth)
        self.children: list[dict[int, int]] = [{}]  # [node] token -> child
        self.count: list[int] = [0]  # [node] occurrences of the substring it spells
        self.last: list[int] = [0]  # [node] clock of its most recent occurrence
        self.free: list[int] = []  # unlinked nodes, to reuse
        self.clock = 0  # tokens appended so far, over every sequence

    def append(self, active: list[int], token: int) -> list[int]:
        """Count the suffixes ending at `token`; returns the new active list."""
        self.clock += 1
        clock, children, count, last, free = self.clock, self.children, self.count, self.last, self.free
        extended = []
        for node in (0, *active[: self.depth - 1]):  # locals only: it runs depth times a token
            kids = children[node]
            child = kids.get(token)
            if child is None:
                if free:
                    child = free.pop()
                    children[child], count[child] = {}, 0
                else:
                    child = len(count)
                    children.append({})
                    count.append(0)
                    last.append(0)
                kids[token] = child
            count[child] += 1
            last[child] = clock
            extended.append(child)
        return extended

    def extend(self, active: list[int], tokens: Sequence[int]) -> list[int]:
        """Count the suffixes ending at each of `tokens` in turn; returns the final active list."""
        for token in tokens:
            active = self.append(active, token)
        return active

    def match(self, active: list[int], max_match: int) -> int:
        """The length of the longest suffix in `active` (of at most `max_match` tokens) that has a
        continuation; 0 where none has."""
        for match in range(min(max_match, len(active)), 0, -1):
            if self.children[active[match - 1]]:
                return match
        return 0

    def substrings(self) -> dict[tuple[int, ...], int]:
        """Every substring counted, with its count (for tests)."""
        out, stack = {}, [(0, ())]
        while stack:
            node, prefix = stack.pop()
            for token, child in self.children[node].items():
                out[prefix + (token,)] = self.count[child]
                stack.append((child, prefix + (token,)))
        return out

    def remove(self, tokens: list[int]) -> None:
        """Uncount a whole sequence appended earlier (its oldest occurrences go first, so
        each remaining node's `last` still belongs to a remaining occurrence)."""
        active: list[int] = []
        for token in tokens:
            extended = []
            for node in (0, *active[: self.depth - 1]):
                child = self.children[node][token]
                self.count[child] -= 1
                if self.count[child] == 0:  # its descendants reach 0 in this same pass
                    del self.children[node][token]
                    self.free.append(child)
                extended.append(child)
            active = extended

    def continuation(self, node: int, limit: int, min_probability: float) -> list[int]:
        """Walk the most frequent (then most recent) children while the path's probability holds."""
        out: list[int] = []
        probability = 1.0
        while len(out) < limit and self.children[node]:
            token, child = max(self.children[node].items(), key=lambda item: (self.count[item[1]], self.last[item[1]]))
            probability *= self.count[child] / self.count[node]
            if probability < min_probability:
                break
            out.append(token)
            node = child
        return out

    def speculation_tree(
        self, node: int, limit: int, max_depth: int, min_probability: float
    ) -> tuple[list[int], list[int]]:
        """SuffixDecoding's speculation tree below `node`: (tokens, parents) of up to `limit` nodes, added
        best first by the empirical probability of their path (ties: the most recent), each of
        probability at least `min_probability` and depth below `max_depth`."""
        tokens: list[int] = []
        parents: list[int] = []
        heap: list[tuple[float, int, int, int, int, int]] = []  # (-probability, -last, order, token, node, parent)

        def push(above: int, index: int, probability: float, depth: int) -> None:
            for token, child in self.children[above].items() if depth < max_depth else ():
                p = probability * self.count[child] / self.count[above]
                if p >= min_probability:
                    heapq.heappush(heap, (-p, -self.last[child], len(heap) + len(tokens), token, child, index))

        push(node, -1, 1.0, 0)
        depth = [0]  # of the nodes added, by index + 1 (the root's children at 0)
        while heap and len(tokens) < limit:
            probability, _, _, token, child, parent = heapq.heappop(heap)
            tokens.append(token)
            parents.append(parent)
            depth.append(depth[parent + 1] + 1)
            push(child, len(tokens) - 1, -probability, depth[-1])
        return tokens, parents


class NativeSuffixTree:
    """`SuffixTree` in C++ (suffix_tree.cpp): the same counts and walks, each call over whole arrays.

    Counting a token costs its `depth` hash-map steps in C++ rather than in the interpreter: a
    1,400-token prompt at depth 24 took about 11 ms in Python, up to 2% of a request."""

    def __init__(self, depth: int, library: ctypes.CDLL) -> None:
        self.depth, self.lib = checked_depth(depth), library
        self.handle = ctypes.c_void_p(library.specsample_suffix_new(depth))
        self.active_out = (ctypes.c_int32 * depth)()

    def __del__(self) -> None:
        if getattr(self, "handle", None):
            self.lib.specsample_suffix_free(self.handle)

    @property
    def clock(self) -> int:
        return self.lib.specsample_suffix_clock(self.handle)

    def extend(self, active: list[int], tokens: Sequence[int]) -> list[int]:
        n = self.lib.specsample_suffix_extend(self.handle, int32s(active), len(active), int32s(tokens), len(tokens),
                                              self.active_out)
        return self.active_out[:n]

    def remove(self, tokens: list[int]) -> None:
        if self.lib.specsample_suffix_remove(self.handle, int32s(tokens), len(tokens)):
            raise KeyError("removing a sequence the tree never counted")

    def match(self, active: list[int], max_match: int) -> int:
        return self.lib.specsample_suffix_match(self.handle, int32s(active), len(active), max_match)

    def continuation(self, node: int, limit: int, min_probability: float) -> list[int]:
        out = (ctypes.c_int32 * limit)()
        return out[: self.lib.specsample_suffix_continuation(self.handle, node, limit, min_probability, out)]

    def speculation_tree(self, node: int, limit: int, max_depth: int, min_probability: float) -> tuple[list[int], list[int]]:
        tokens, parents = (ctypes.c_int32 * limit)(), (ctypes.c_int32 * limit)()
        n = self.lib.specsample_suffix_speculation_tree(self.handle, node, limit, max_depth, min_probability, tokens, parents)
        return tokens[:n], parents[:n]

    def substrings(self) -> dict[tuple[int, ...], int]:
        n = self.lib.specsample_suffix_nodes(self.handle)
        parents, tokens, children = ((ctypes.c_int32 * n)() for _ in range(3))
        counts = (ctypes.c_int64 * n)()
        self.lib.specsample_suffix_edges(self.handle, parents, tokens, children, counts)
        edges = {child: (parent, token, count) for parent, token, child, count in zip(parents, tokens, children, counts)}

        def spelled(node: int) -> tuple[int, ...]:
            parent, token, _ = edges[node]
            return (*spelled(parent), token) if parent else (token,)

        return {spelled(child): count for child, (_, _, count) in edges.items()}


def int32s(values: Sequence[int]) -> np.ndarray:
    """`values` as a C array of int32 (numpy: a ctypes array built from a list costs about 1 us a value)."""
    return np.asarray(values, dtype=np.int32)


@cache
def native_library() -> ctypes.CDLL | None:
    """suffix_tree.cpp, built on first use (models.kernels.compiled); None where it cannot be built,
    or with SPECSAMPLE_NO_KERNELS set."""
    if os.environ.get("SPECSAMPLE_NO_KERNELS"):
        return None
    from specsample.models.kernels import compiled

    source = resources.files(__package__).joinpath("suffix_tree.cpp").read_text()
    lib = compiled("suffix-tree", {"suffix_tree.cpp": source}, ["-O2", "-shared", "-fPIC", "-std=c++17"],
                   "counting in Python")
    if lib is None:
        return None
    p, i32, n = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    ints = np.ctypeslib.ndpointer(np.int32, flags="C_CONTIGUOUS")
    declare = {
        "specsample_suffix_new": ([i32], p), "specsample_suffix_free": ([p], None),
        "specsample_suffix_clock": ([p], ctypes.c_int64), "specsample_suffix_nodes": ([p], n),
        "specsample_suffix_extend": ([p, ints, i32, ints, n, p], i32), "specsample_suffix_remove": ([p, ints, n], i32),
        "specsample_suffix_match": ([p, ints, i32, i32], i32),
        "specsample_suffix_continuation": ([p, ctypes.c_int32, i32, ctypes.c_double, p], i32),
        "specsample_suffix_speculation_tree": ([p, ctypes.c_int32, i32, i32, ctypes.c_double, p, p], i32),
        "specsample_suffix_edges": ([p, p, p, p, p], None),
    }
    for name, (argtypes, restype) in declare.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, restype
    return lib


def suffix_tree(depth: int) -> SuffixTree | NativeSuffixTree:
    """A suffix tree of `depth`: in C++ where it builds, else in Python (the same results)."""
    library = native_library()
    return SuffixTree(depth) if library is None else NativeSuffixTree(depth, library)


class SuffixDrafter(LookupDrafter):
    def __init__(
        self,
        depth: int = 24,
        max_match: int = 12,
        growth: float = 2.0,
        min_probability: float = 0.1,
        history_tokens: int = 20_000,
    ) -> None:
        if not 1 <= max_match < depth:
            raise ValueError(f"need 1 <= max_match < depth, got max_match={max_match}, depth={depth}")
        self.tree = suffix_tree(depth)
        self.max_match, self.growth, self.min_probability = max_match, growth, min_probability
        self.history_tokens = history_tokens
        self.history: deque[list[int]] = deque()  # earlier requests still counted, oldest first
        self.tokens: list[int] = []  # the current request: prompt, then every emitted token
        self.indexed = 0  # of them, those counted in the tree
        self.active: list[int] = []  # the suffix nodes of tokens[:indexed] (`SuffixTree.extend`)

    def begin(self, prompt_ids: Tensor, params: SamplingParams) -> None:
        self.retire()
        self.tokens, self.indexed, self.active = [], 0, []
        self.extend(prompt_ids.tolist())
        self.index()

    def lookup(self, k: int) -> list[int]:
        """The most frequent continuation of the longest suffix that occurred before with one."""
        node, depth = self.matched()
        return [] if node is None else self.tree.continuation(node, min(k, depth), self.min_probability)

    def matched(self) -> tuple[int | None, int]:
        """The node of the longest suffix that occurred before with a continuation, and how deep to draft
        below it (`growth` times the match length); None where no suffix did."""
        self.index()
        match = self.tree.match(self.active, self.max_match)
        return (self.active[match - 1], max(1, int(self.growth * match))) if match else (None, 0)

    def extend(self, new: list[int]) -> None:
        """The context grows by `new`; the tree counts it at the next `index`."""
        self.tokens.extend(new)

    def index(self) -> None:
        """Count the tokens of the context the tree has not counted yet."""
        if self.indexed < len(self.tokens):
            self.active = self.tree.extend(self.active, self.tokens[self.indexed :])
            self.indexed = len(self.tokens)

    def retire(self) -> None:
        """File the finished request under history; evict the oldest beyond `history_tokens`."""
        if self.tokens:
            self.index()
            self.history.append(self.tokens)
            self.tokens = []
        while self.history_size > self.history_tokens:
            self.tree.remove(self.history.popleft())

    def end(self) -> None:
        """The request ended (`base.EndsRequests`): file it now."""
        self.retire()

    @property
    def history_size(self) -> int:
        """Tokens of earlier requests still counted in the tree."""
        return sum(map(len, self.history))

    def fork(self) -> SuffixDrafter:
        """A drafter for another request decoded at the same time (`base.Forks`): its own context,
        this one's tree and history, so each learns from the requests the others finished. A fork
        files its request under the shared history when it begins the next one."""
        fork = type(self)(self.tree.depth, self.max_match, self.growth, self.min_probability, self.history_tokens)
        fork.tree, fork.history = self.tree, self.history
        return fork


class SuffixTreeDrafter(SuffixDrafter):
    """`suffix` drafting SuffixDecoding's speculation tree (several continuations of the matched suffix,
    the most frequent first) instead of its single most frequent one: up to k nodes."""

    def propose(self, k: int, random: RandomSource) -> Draft:
        node, depth = self.matched()
        if node is None:
            return Draft.tree([], [])
        return Draft.tree(*self.tree.speculation_tree(node, k, depth, self.min_probability))
