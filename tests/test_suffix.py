"""The suffix tree and the `suffix` drafter against brute force on random token strings."""

from __future__ import annotations

from contextlib import contextmanager
from unittest.mock import patch

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specsample.drafters import suffix
from specsample.drafters.suffix import NativeSuffixTree, SuffixDrafter, SuffixTree
from specsample.sampling import SamplingParams

tokens = st.lists(st.integers(0, 3), max_size=30)  # a small alphabet, so substrings repeat

# The tree in Python and in C++ (suffix_tree.cpp, what the drafter uses where it builds): each test runs on both,
# except where the C++ cannot be built (no compiler, or SPECSAMPLE_NO_KERNELS=1): the drafter then counts in Python.
needs_native = pytest.mark.skipif(suffix.native_library() is None, reason="the C++ suffix tree could not be built here")
IMPLEMENTATIONS = ["python", pytest.param("native", marks=needs_native)]


def make_tree(implementation: str, depth: int) -> SuffixTree | NativeSuffixTree:
    if implementation == "python":
        return SuffixTree(depth)
    library = suffix.native_library()
    assert library is not None, "the C++ suffix tree did not build"
    return NativeSuffixTree(depth, library)


@contextmanager
def implemented_in(implementation: str):
    """Drafters made inside use the tree of `implementation`."""
    with patch.object(suffix, "suffix_tree", lambda depth: make_tree(implementation, depth)):
        yield


def brute_counts(sequences: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    out: dict[tuple[int, ...], int] = {}
    for seq in sequences:
        for end in range(1, len(seq) + 1):
            for n in range(1, min(depth, end) + 1):
                key = tuple(seq[end - n : end])
                out[key] = out.get(key, 0) + 1
    return out


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@settings(max_examples=150, deadline=None)
@given(st.lists(tokens, min_size=1, max_size=5), st.integers(2, 6), st.integers(0, 5), st.integers(1, 4))
def test_tree_counts_every_substring_up_to_its_depth(implementation, sequences, depth, evicted, pieces):
    """Also when each sequence is counted in `pieces` calls (the drafter counts what was emitted since its last draft)."""
    tree = make_tree(implementation, depth)
    for seq in sequences:
        active: list[int] = []
        for start in range(0, len(seq), pieces):
            active = tree.extend(active, seq[start : start + pieces])
    evicted = min(evicted, len(sequences))
    for seq in sequences[:evicted]:
        tree.remove(seq)
    assert tree.substrings() == brute_counts(sequences[evicted:], depth)
    for seq in sequences[evicted:]:  # the nodes freed by eviction are reused, counting from zero
        tree.extend([], seq)
    assert tree.substrings() == brute_counts(sequences[evicted:] * 2, depth)


@needs_native
@settings(max_examples=150, deadline=None)
@given(st.lists(tokens, min_size=1, max_size=5), st.integers(2, 6), st.integers(0, 3), st.integers(1, 12),
       st.sampled_from([0.0, 0.05, 0.3]))
def test_the_native_tree_walks_as_the_python_tree(sequences, depth, evicted, limit, min_probability):
    """Matches, continuations and speculation trees (ties included: a small alphabet) are the same in C++."""
    trees = [make_tree(implementation, depth) for implementation in ("python", "native")]
    for tree in trees:
        for seq in sequences:
            tree.extend([], seq)
        for seq in sequences[: min(evicted, len(sequences) - 1)]:
            tree.remove(seq)
    python, native = trees
    active = python.extend([], sequences[-1])
    assert native.extend([], sequences[-1]) == active and python.clock == native.clock
    for max_match in range(1, depth):
        assert python.match(active, max_match) == native.match(active, max_match)
    for node in active:  # the nodes a drafter walks from (never the root, whose count is 0)
        assert python.continuation(node, limit, min_probability) == native.continuation(node, limit, min_probability)
        for max_depth in (1, 3, depth):
            assert python.speculation_tree(node, limit, max_depth, min_probability) == \
                native.speculation_tree(node, limit, max_depth, min_probability)


@needs_native
def test_removing_what_was_never_counted_is_refused():
    tree = make_tree("native", 4)
    tree.extend([], [1, 2, 3])
    with pytest.raises(KeyError):
        tree.remove([3, 2, 1])


def brute_proposal(sequences, clocks, depth, max_match, growth, min_probability, k) -> list[int]:
    """The drafter's rule, by scanning every occurrence: longest suffix of the last
    sequence with a continuation, then the most frequent (then most recent) next token."""

    def occurrences(s):  # clocks of the last tokens of every occurrence of s
        return [
            clock[end - 1]
            for seq, clock in zip(sequences, clocks)
            for end in range(len(s), len(seq) + 1)
            if tuple(seq[end - len(s) : end]) == s
        ]

    def children(s):
        found = {}
        for c in range(4):
            occ = occurrences(s + (c,))
            if occ:
                found[c] = (len(occ), max(occ))
        return found

    context = sequences[-1]
    for match in range(min(max_match, len(context)), 0, -1):
        s = tuple(context[-match:])
        if not children(s):
            continue
        out, probability = [], 1.0
        while len(out) < min(k, max(1, int(growth * match))) and len(s) < depth and children(s):
            token, (count, _) = max(children(s).items(), key=lambda item: item[1])
            probability *= count / len(occurrences(s))
            if probability < min_probability:
                break
            out.append(token)
            s = s + (token,)
        return out
    return []


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(tokens.filter(bool), tokens), min_size=1, max_size=4),  # (prompt, output) per request
    st.integers(3, 7),
    st.integers(1, 10),
    st.sampled_from([1.0, 2.0]),
    st.sampled_from([0.0, 0.3]),
    st.integers(0, 40),
    st.sets(st.integers(0, 20)),
)
def test_drafter_proposes_what_brute_force_finds(implementation, requests, depth, k, growth, min_probability,
                                                 history_tokens, asked):
    """Also when asked for drafts at some steps (`asked`, by output position) and not at others, so that
    the tree counts the tokens emitted since the last proposal in one go."""
    max_match = depth - 1
    with implemented_in(implementation):
        drafter = SuffixDrafter(depth, max_match, growth, min_probability, history_tokens)
    sequences, clocks, clock = [], [], 0
    for prompt, output in requests:
        drafter.begin(torch.tensor(prompt), SamplingParams())
        for i, token in enumerate(output):
            if i in asked:
                drafter.propose(k, torch.Generator())
            drafter.observe([token])
        sequences.append(prompt + output)
        clocks.append(list(range(clock + 1, clock + 1 + len(sequences[-1]))))
        clock += len(sequences[-1])
    kept = len(drafter.history) + 1  # earlier requests still counted, then the current one
    assert sum(map(len, sequences[-kept:-1])) <= history_tokens
    assert kept == len(sequences) or sum(map(len, sequences[-kept - 1 : -1])) > history_tokens
    expected = brute_proposal(sequences[-kept:], clocks[-kept:], depth, max_match, growth, min_probability, k)
    assert drafter.propose(k, torch.Generator()).tokens.tolist() == expected


def test_emitted_tokens_are_counted_when_a_draft_is_asked_for():
    """While the K policy asks for no draft, observing a token leaves the tree alone (no work in a plain
    step); the next proposal counts every token emitted since."""
    drafter = SuffixDrafter()
    drafter.begin(torch.tensor([7, 1, 2, 3]), SamplingParams())
    counted = drafter.tree.clock
    for token in [4, 5, 9, 1, 2]:
        drafter.observe([token])
    assert drafter.tree.clock == counted
    assert drafter.propose(3, torch.Generator()).tokens.tolist() == [3, 4, 5]
    assert drafter.tree.clock == counted + 5


def test_a_repeated_phrase_is_proposed_whole():
    drafter = SuffixDrafter()
    drafter.begin(torch.tensor([7, 1, 2, 3, 4, 5, 6, 9, 9, 1, 2, 3]), SamplingParams())
    assert drafter.propose(3, torch.Generator()).tokens.tolist() == [4, 5, 6]


def test_earlier_requests_are_drafted_from_until_evicted():
    drafter = SuffixDrafter(history_tokens=8)
    drafter.begin(torch.tensor([10, 11, 12, 13, 14]), SamplingParams())
    drafter.begin(torch.tensor([20, 10, 11]), SamplingParams())
    assert drafter.propose(3, torch.Generator()).tokens.tolist() == [12, 13, 14]
    drafter.begin(torch.tensor([30, 31, 32, 33]), SamplingParams())  # history now 5 + 3 + ... > 8
    drafter.begin(torch.tensor([40, 10, 11]), SamplingParams())
    assert drafter.propose(3, torch.Generator()).tokens.tolist() == []


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="max_match"):
        SuffixDrafter(depth=4, max_match=4)


def test_the_tree_holds_nothing_the_garbage_collector_walks():
    import gc

    tree = SuffixTree(24)
    active: list[int] = []
    for token in range(2000):
        active = tree.append(active, token % 97)
    assert len(tree.count) > 2000
    assert not any(gc.is_tracked(kids) for kids in tree.children)
