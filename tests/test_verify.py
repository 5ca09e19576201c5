"""Unit tests of the pure verification functions (the distributional proof is test_lossless.py)."""

import torch

from specsample.sampling import Rows
from specsample.verify import greedy_verify, leading_true, rejection_sample, residual


def one_hot(i, n=4):
    return torch.nn.functional.one_hot(torch.tensor(i), n).float()


def test_leading_true():
    assert int(leading_true(torch.tensor([True, True, False, True]))) == 2
    assert int(leading_true(torch.tensor([False, True]))) == 0
    assert int(leading_true(torch.tensor([], dtype=torch.bool))) == 0


def test_greedy_accepts_the_matching_prefix_then_corrects():
    target_logits = torch.stack([one_hot(1), one_hot(2), one_hot(3), one_hot(0)])
    verdict = greedy_verify(torch.tensor([1, 2, 0]), target_logits)
    assert (verdict.accepted, verdict.next_token) == (2, 3)
    verdict = greedy_verify(torch.tensor([1, 2, 3]), target_logits)
    assert (verdict.accepted, verdict.next_token) == (3, 0)  # bonus


def test_draft_with_zero_target_probability_is_always_rejected():
    target_probs = torch.stack([torch.tensor([0.0, 0.5, 0.5, 0.0])] * 2)
    draft_probs = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    gen = torch.Generator().manual_seed(0)
    for _ in range(100):
        verdict = rejection_sample(torch.tensor([0]), draft_probs, target_probs, gen)
        assert verdict.accepted == 0 and verdict.next_token in (1, 2)


def test_draft_dominated_by_target_is_always_accepted():
    target_probs = torch.tensor([[0.1, 0.9, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    draft_probs = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    gen = torch.Generator().manual_seed(0)
    for _ in range(100):
        verdict = rejection_sample(torch.tensor([1]), draft_probs, target_probs, gen)
        assert (verdict.accepted, verdict.next_token) == (1, 3)


def test_residual_of_a_point_mass_removes_the_draft_token():
    target_probs = torch.tensor([[0.25, 0.25, 0.5, 0.0]])
    res = residual(torch.tensor([2]), None, target_probs, 0)
    assert torch.allclose(res, torch.tensor([0.5, 0.5, 0.0, 0.0]))


def test_residual_is_the_normalised_positive_part():
    target_probs = torch.tensor([[0.5, 0.3, 0.2, 0.0]])
    draft_probs = torch.tensor([[0.2, 0.6, 0.2, 0.0]])
    res = residual(torch.tensor([1]), draft_probs, target_probs, 0)
    assert torch.allclose(res, torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_same_seed_same_verdicts():
    target_probs = torch.rand(4, 16).softmax(-1)
    draft_probs = torch.rand(3, 16).softmax(-1)
    tokens = torch.tensor([1, 2, 3])
    runs = [
        [rejection_sample(tokens, draft_probs, target_probs, gen) for _ in range(20)]
        for gen in (torch.Generator().manual_seed(5), torch.Generator().manual_seed(5))
    ]
    assert runs[0] == runs[1]


def counted_rows(table: torch.Tensor) -> tuple[Rows, list[int]]:
    """`table` [n, width] as `sampling.Rows`, and the list of the rows it made, in order."""

    made: list[int] = []
    return Rows(table.shape[0], lambda i: made.append(i) or table[i]), made


def test_lazy_rows_give_the_tensors_verdicts_reading_rows_up_to_the_first_rejection():
    """Over random chains, modified rejection sampling and coupled verification read target_probs (and
    the noise) as `sampling.Rows` only up to the row of their verdict, and give the verdict they give
    over whole tensors, the generator consumed alike: so a draft rejected at its first token costs one
    row's sampling transform, not k + 1."""
    from specsample.sampling import position_noise
    from specsample.verify import coupled_tokens, coupled_verify

    gen = torch.Generator().manual_seed(7)
    reached = set()
    for trial in range(300):
        k, vocab = int(torch.randint(0, 6, (1,), generator=gen)), 8
        target_probs = (torch.rand(k + 1, vocab, generator=gen) ** 4).softmax(-1)
        draft_probs = None if trial % 2 else (torch.rand(k, vocab, generator=gen) ** 4).softmax(-1)
        seed = int(torch.randint(0, 2**31, (1,), generator=gen))
        noise = torch.stack([position_noise(seed, i, vocab) for i in range(k + 1)])
        # a third of the chains are the target's own coupled tokens, accepted whole by coupled verification
        tokens = coupled_tokens(target_probs, noise)[:k] if trial % 3 == 0 else torch.randint(0, vocab, (k,), generator=gen)
        whole = rejection_sample(tokens, draft_probs, target_probs, torch.Generator().manual_seed(seed))
        rows, made = counted_rows(target_probs)
        lazy = rejection_sample(tokens, draft_probs, rows, torch.Generator().manual_seed(seed))
        assert lazy == whole and made == list(range(whole.accepted + 1))
        whole = coupled_verify(tokens, target_probs, noise)
        rows, made = counted_rows(target_probs)
        noise_rows, noise_made = counted_rows(noise)
        assert coupled_verify(tokens, rows, noise_rows) == whole
        assert made == noise_made == list(range(whole.accepted + 1))
        reached.add((k, whole.accepted))
    assert {(k, 0) for k in range(1, 6)} <= reached and (5, 5) in reached  # early rejections and whole chains
