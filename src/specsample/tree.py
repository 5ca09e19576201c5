"""Trees of tokens as parent arrays: what the drafters, the verifier and the target backends share.

A tree of n tokens is `parents` [n] int64: the index of each token's parent, -1 for a child of
the root (for a draft, the pending token), every parent before its child (topological order),
so every prefix of a tree is a tree. A chain is parents i - 1.
"""

from __future__ import annotations

import torch
from torch import Tensor


def chain_parents(k: int) -> Tensor:
    """The parent array [k] of a chain of k tokens: -1, 0, 1, ..., k - 2."""
    return torch.arange(-1, k - 1)


def children_of(parents: Tensor) -> list[list[int]]:
    """[n + 1] lists: entry 0 the root's children, entry i + 1 token i's, each in order."""
    children: list[list[int]] = [[] for _ in range(parents.shape[0] + 1)]
    for node, parent in enumerate(parents.tolist()):
        children[parent + 1].append(node)
    return children


def depths(parents: Tensor) -> Tensor:
    """[n] the depth of each token: the number of its ancestors (0 for a child of the root)."""
    out: list[int] = []
    for parent in parents.tolist():
        out.append(0 if parent < 0 else out[parent] + 1)
    return torch.tensor(out, dtype=torch.long)


def visibility(parents: Tensor) -> Tensor:
    """[n, n] bool: token t sees token u where u is t or one of its ancestors (tree attention)."""
    n = parents.shape[0]
    seen = torch.eye(n, dtype=torch.bool)
    for t, parent in enumerate(parents.tolist()):
        if parent >= 0:
            seen[t] |= seen[parent]
    return seen


def trie(sequences: list[list[int]]) -> tuple[list[int], list[int]]:
    """The tree (tokens, parents) of the prefixes of `sequences`: shared prefixes merged, the first
    sequence's tokens first, a token's first-seen siblings before later ones."""
    tokens: list[int] = []
    parents: list[int] = []
    index: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    for sequence in sequences:
        parent = -1
        for token in sequence:
            if (parent, token) not in index:
                index[parent, token] = len(tokens)
                tokens.append(token)
                parents.append(parent)
            parent = index[parent, token]
    return tokens, parents


def reached(parents: Tensor, path: tuple[int, ...]) -> list[tuple[int, int, bool]]:
    """(depth, sibling rank, accepted) of each node that a verification accepting `path` (root first) reached:
    the children of the root and of the accepted nodes. Rank r: the node is its parent's (r + 1)-th child."""
    children = children_of(parents)
    rows = [0] + [node + 1 for node in path]
    return [
        (depth, rank, depth < len(path) and path[depth] == child)
        for depth, row in enumerate(rows)
        for rank, child in enumerate(children[row])
    ]
