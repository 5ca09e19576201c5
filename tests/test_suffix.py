"""The suffix tree and the `suffix` drafter against brute force on random token strings."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specsample.drafters.suffix import SuffixDrafter, SuffixTree
from specsample.sampling import SamplingParams

tokens = st.lists(st.integers(0, 3), max_size=30)  # a small alphabet, so substrings repeat


def tree_counts(tree: SuffixTree, node: int = 0, prefix: tuple[int, ...] = ()) -> dict[tuple[int, ...], int]:
    out = {}
    for token, child in tree.children[node].items():
        out[prefix + (token,)] = tree.count[child]
        out.update(tree_counts(tree, child, prefix + (token,)))
    return out


def brute_counts(sequences: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    out: dict[tuple[int, ...], int] = {}
    for seq in sequences:
        for end in range(1, len(seq) + 1):
            for n in range(1, min(depth, end) + 1):
                key = tuple(seq[end - n : end])
                out[key] = out.get(key, 0) + 1
    return out


@settings(max_examples=150, deadline=None)
@given(st.lists(tokens, min_size=1, max_size=5), st.integers(2, 6), st.integers(0, 5))
def test_tree_counts_every_substring_up_to_its_depth(sequences, depth, evicted):
    tree = SuffixTree(depth)
    for seq in sequences:
        active: list[int] = []
        for token in seq:
            active = tree.append(active, token)
    evicted = min(evicted, len(sequences))
    for seq in sequences[:evicted]:
        tree.remove(seq)
    assert tree_counts(tree) == brute_counts(sequences[evicted:], depth)
    for seq in sequences[evicted:]:  # the nodes freed by eviction are reused, counting from zero
        active = []
        for token in seq:
            active = tree.append(active, token)
    assert tree_counts(tree) == brute_counts(sequences[evicted:] * 2, depth)


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
def test_drafter_proposes_what_brute_force_finds(requests, depth, k, growth, min_probability, history_tokens, asked):
    """Also when asked for drafts at some steps (`asked`, by output position) and not at others, so that
    the tree counts the tokens emitted since the last proposal in one go."""
    max_match = depth - 1
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
