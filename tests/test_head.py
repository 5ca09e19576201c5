"""The head drafter: lossless and greedy-identical on a tiny target, trainable, tied to its target."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import test_lossless
from specsample.drafters import NoDrafter, make_drafter
from specsample.drafters import head as head_module
from specsample.drafters.head import CATCH_UP_BATCH, DraftHead, HeadConfig, HeadDrafter, save_head
from specsample.engine import decode
from specsample.models import LoadedModel, backend_of, kernels, load_model, make_target
from specsample.policy import FixedK
from specsample.sampling import GeneratorSource, SamplingParams, request_source
from specsample.stats import Stats
from specsample.prompts import read_prompts
from specsample.training import TrainOptions, data_shards, train
from specsample.training.dataset import Sequence, frequent_tokens, load_sequences, prompt_hash, split
from specsample.training.generate import Writer, generate_shards, model_fingerprint, seeds_for, teacher_forced_features, write_prompts
from specsample.training.objective import Objective
from test_lossless import ALPHA, VOCAB, chi_square_p, exact_distribution, sampled_counts

from conftest import drafting_cost_model, tiny_llama

SUBSET = 12  # of VOCAB: the head cannot propose 4 of the tokens
N_SAMPLES = 20_000


def tiny_loaded(model) -> LoadedModel:
    return LoadedModel(model, None, "tiny", frozenset(), 0.0)


def tiny_head(loaded: LoadedModel, subset: int, feature_layers: tuple[int, ...] = ()) -> tuple[DraftHead, torch.Tensor]:
    torch.manual_seed(0)
    head = DraftHead(HeadConfig.for_target(loaded, vocab_subset=subset, feature_layers=feature_layers))
    head.init_from_target(loaded.model)
    return head.eval(), torch.arange(subset)


def head_drafter(loaded: LoadedModel, target, subset: int = SUBSET) -> HeadDrafter:
    head, token_ids = tiny_head(loaded, subset)
    hf = loaded.model
    return HeadDrafter(target, head, hf.get_input_embeddings().weight, hf.get_output_embeddings().weight, token_ids)


def test_head_sampling_matches_target_distribution(monkeypatch):
    """Chi-square at significance ALPHA, through test_lossless's machinery, with a subset-restricted head.

    N_SAMPLES sequences, fewer than test_lossless draws, keep the test's time near
    theirs (a head step costs more than a tiny draft model's).
    """
    model = tiny_llama(VOCAB, seed=0)
    loaded = tiny_loaded(model)
    target = make_target(loaded)
    monkeypatch.setattr(test_lossless, "as_target", lambda _: target)  # the drafter reads this target's features
    monkeypatch.setattr(test_lossless, "N_SAMPLES", N_SAMPLES)
    params = SamplingParams(temperature=0.8)
    observed = sampled_counts(model, head_drafter(loaded, target), params, seed=4321)
    p = chi_square_p(observed, exact_distribution(model, params))
    assert p > ALPHA, f"p = {p:.2e}"


@pytest.mark.parametrize(("backend", "policy"), [("fast", "fixed"), ("transformers", "fixed"), ("fast", "cost-model")])
def test_head_greedy_output_is_the_targets(backend, policy):
    """The cost model also cuts the head's drafts on their confidence."""
    loaded = tiny_loaded(tiny_llama(64, seed=3))
    prompt = torch.tensor([5, 9, 2, 33, 7])
    outputs, stats = [], []
    policies = {"fixed": lambda: FixedK(4), "cost-model": drafting_cost_model}
    for make in (lambda t: NoDrafter(), lambda t: head_drafter(loaded, t, subset=48)):
        target = make_target(loaded, backend)
        stats.append(Stats())
        steps = decode(target, make(target), policies[policy](), prompt, SamplingParams(temperature=0),
                       max_new_tokens=40, eos_token_ids=frozenset(), random=GeneratorSource(torch.Generator().manual_seed(0)),
                       stats=stats[-1])
        outputs.append([t for step in steps for t in step])
    assert outputs[0] == outputs[1]
    assert stats[1].drafted_tokens > 0


def test_head_reports_the_peak_of_its_distribution_as_confidence():
    loaded = tiny_loaded(tiny_llama(64, seed=3))
    target = make_target(loaded)
    drafter = head_drafter(loaded, target, subset=48)
    target.prefill(torch.tensor([5, 9, 2, 33]))
    drafter.begin(torch.tensor([5, 9, 2, 33, 7]), SamplingParams(temperature=0))
    peak = float(drafter.logits.softmax(-1).max())
    draft = drafter.propose(3, GeneratorSource(torch.Generator().manual_seed(0)))
    assert draft.confidence.shape == (3,) and float(draft.confidence[0]) == pytest.approx(peak)
    assert ((draft.confidence > 0) & (draft.confidence <= 1)).all()


def test_a_head_that_skipped_steps_catches_up_to_the_draft_it_would_have_made():
    """Steps that do not draft leave the head's work for the next draft, which then proposes what
    a head that drafted at every step would (the same tokens and, to rounding, the same probabilities)."""
    loaded = tiny_loaded(tiny_llama(64, seed=3))
    params, generator = SamplingParams(temperature=0.8), torch.Generator()
    target = make_target(loaded)
    eager, lazy = head_drafter(loaded, target, subset=48), head_drafter(loaded, target, subset=48)
    prompt = torch.tensor([5, 9, 2, 33, 7])
    target.prefill(prompt[:-1])
    eager.begin(prompt, params)
    lazy.begin(prompt, params)
    for pending, accepted in [(7, []), (12, [40, 3]), (8, [21])]:  # the tokens each step emits after `pending`
        eager.propose(3, GeneratorSource(generator.manual_seed(0)))
        target.score(torch.tensor([pending, *accepted]))
        eager.observe([pending, *accepted])
        lazy.observe([pending, *accepted])
    assert lazy.decoder.length < eager.decoder.length  # the lazy head has not run since the prompt
    drafts = [d.propose(4, GeneratorSource(generator.manual_seed(1))) for d in (eager, lazy)]
    assert lazy.decoder.length == eager.decoder.length
    assert drafts[0].tokens.tolist() == drafts[1].tokens.tolist()
    torch.testing.assert_close(drafts[0].probs, drafts[1].probs, rtol=1e-4, atol=1e-5)


def test_a_head_that_does_not_draft_runs_over_its_kept_positions_in_batches():
    """The prompt is read at `begin`; plain steps are kept until CATCH_UP_BATCH positions wait, so a
    draft after a long plain stretch pays for fewer than CATCH_UP_BATCH of them."""
    loaded = tiny_loaded(tiny_llama(64, seed=3))
    target = make_target(loaded)
    drafter = head_drafter(loaded, target, subset=48)
    prompt = torch.tensor([5, 9, 2, 33, 7])
    target.prefill(prompt[:-1])
    drafter.begin(prompt, SamplingParams())
    assert drafter.decoder.length == len(prompt) - 1
    for i in range(CATCH_UP_BATCH):
        assert drafter.decoder.length == len(prompt) - 1  # the kept positions wait
        target.score(torch.tensor([10 + i]))
        drafter.observe([10 + i])
    assert drafter.decoder.length == len(prompt) - 1 + CATCH_UP_BATCH
    assert drafter.unread == []


def test_the_head_reads_only_the_prompts_last_window_and_greedy_output_stays_the_targets(monkeypatch):
    """With a prompt longer than PROMPT_WINDOW the head runs over its last PROMPT_WINDOW positions only
    (then reads each step's positions as before), it still drafts, and greedy output is the target's."""
    monkeypatch.setattr(head_module, "PROMPT_WINDOW", 3)
    loaded = tiny_loaded(tiny_llama(64, seed=3))
    prompt = torch.tensor([5, 9, 2, 33, 7, 40, 12, 8])
    target = make_target(loaded)
    drafter = head_drafter(loaded, target, subset=48)
    target.prefill(prompt[:-1])
    drafter.begin(prompt, SamplingParams(temperature=0))
    assert drafter.decoder.length == 3 and drafter.read == len(prompt) - 1
    outputs, stats = [], Stats()
    for make in (lambda t: NoDrafter(), lambda t: head_drafter(loaded, t, subset=48)):
        target = make_target(loaded)
        steps = decode(target, make(target), FixedK(3), prompt, SamplingParams(temperature=0), max_new_tokens=30,
                       eos_token_ids=frozenset(), random=GeneratorSource(torch.Generator().manual_seed(0)), stats=stats)
        outputs.append([t for step in steps for t in step])
    assert outputs[0] == outputs[1]
    assert stats.drafted_tokens > 0


@pytest.mark.parametrize("layers", [(), (1,)])
def test_the_head_drafts_from_the_features_it_was_trained_on(layers):
    """Both backends, after a prefill and after a score, give the head what `teacher_forced_features`
    stored for training: the recorded layers' normalised outputs, then the final state."""
    loaded = tiny_loaded(tiny_llama(64, seed=3))
    tokens = [5, 9, 2, 33, 7, 40, 11]
    _, final, layer_features = teacher_forced_features(loaded, [tokens], layers)
    stored = torch.cat(([layer_features] if layers else []) + [final], -1).float()  # [7, (layers + 1) * hidden]
    for backend in ("fast", "transformers"):
        target = make_target(loaded, backend)
        target.record_features(layers)
        target.prefill(torch.tensor(tokens[:4]))
        target.score(torch.tensor(tokens[4:]))
        assert target.features(4, 7, layers).shape == stored[4:].shape
        torch.testing.assert_close(target.features(0, 7, layers), stored, rtol=0, atol=2e-3)  # float16 storage
        target.prefill(torch.tensor(tokens[:2]))
        torch.testing.assert_close(target.features(0, 2, layers), stored[:2], rtol=0, atol=2e-3)
        with pytest.raises(ValueError, match="positions 0..2 were not recorded"):
            target.features(0, 3, layers)


@pytest.mark.parametrize("backend", ["fast", "transformers"])
def test_an_empty_prefill_records_nothing_and_the_first_pass_records_its_position(backend):
    """A one-token prompt prefills no position: the head's layers then have no output to record (the fast
    backend raised a KeyError, so every one-token prompt with the head failed)."""
    loaded = tiny_loaded(tiny_llama(64, seed=3))
    _, final, layer_features = teacher_forced_features(loaded, [[5, 9]], (1,))
    target = make_target(loaded, backend)
    target.record_features((1,))
    target.prefill(torch.tensor([], dtype=torch.long))
    target.score(torch.tensor([5, 9]))
    stored = torch.cat([layer_features, final], -1).float()
    torch.testing.assert_close(target.features(0, 2, (1,)), stored, rtol=0, atol=2e-3)


@pytest.mark.parametrize("backend", ["fast", "transformers"])
def test_a_target_records_only_its_own_layers(backend):
    target = make_target(tiny_loaded(tiny_llama(64, seed=3)), backend)
    for layers in ([7], [2]):  # the tiny target has 2 layers: the second one's output is the final state
        with pytest.raises(ValueError, match=rf"layers \[{layers[0]}\] are not all among this target's 1..1"):
            target.record_features(layers)
    target.prefill(torch.tensor([5, 9, 2]))
    with pytest.raises(ValueError, match="were not recorded"):
        target.features(0, 2, (1,))


def test_drafting_runs_the_trained_head_exactly():
    """The fast layout of the head (`fast_head`) predicts the features the trained module does,
    over a whole window and one position at a time through its cache, with rollback."""
    loaded = tiny_loaded(tiny_llama(64, seed=3))
    head, token_ids = tiny_head(loaded, 48)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))  # away from the target's own layer
    hf = loaded.model
    embed, lm_head = hf.get_input_embeddings().weight.detach(), hf.get_output_embeddings().weight.detach()
    features, tokens = torch.randn(9, hf.config.hidden_size), torch.randint(0, 64, (9,))
    with torch.no_grad():
        expected = head(features[None], embed[tokens][None])[0][0]  # [9, hidden]
    drafter = HeadDrafter(make_target(loaded), head, embed, lm_head, token_ids, int8=False)
    drafter.step(features[:4], tokens[:4])
    drafter.step(torch.randn(3, hf.config.hidden_size), tokens[4:7])  # positions later rolled back
    drafter.decoder.rollback(4)
    steps = [drafter.step(features[i : i + 1], tokens[i : i + 1]) for i in range(4, 9)]
    torch.testing.assert_close(drafter.decoder.last_hidden, expected[-1:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(steps[-1], expected[-1:] @ lm_head[token_ids].t(), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not kernels.available(), reason="int8 drafting runs on the C++ kernels")
def test_the_int8_head_drafts_close_to_the_float_one():
    """Where the kernels run, the head drafts from int8 weights (a quarter of the bytes): its subset
    logits stay within a tenth of their range of the float head's."""
    loaded = tiny_loaded(tiny_llama(64, seed=3))
    head, token_ids = tiny_head(loaded, 48)
    hf = loaded.model
    embed, lm_head = hf.get_input_embeddings().weight.detach(), hf.get_output_embeddings().weight.detach()
    features, tokens = torch.randn(9, hf.config.hidden_size), torch.randint(0, 64, (9,))
    drafters = [HeadDrafter(make_target(loaded), head, embed, lm_head, token_ids, int8=q) for q in (False, True)]
    assert drafters[1].decoder.lm_head.scales is not None and drafters[1].decoder.layers[0].down.scales is not None
    exact, int8 = (d.step(features, tokens) for d in drafters)  # [9, 48]
    torch.testing.assert_close(int8, exact, atol=0.1 * float(exact.abs().max()), rtol=0)


@pytest.mark.parametrize("layers", [(), (1,)])
def test_each_training_pass_predicts_what_drafting_does(layers):
    """Pass d of the training forward at position m + d - 1 is draft step d from anchor m: the head's
    cache holds positions up to m computed from the target's features (fused from several layers
    with `feature_layers`), then its own predictions."""
    loaded = tiny_loaded(tiny_llama(64, seed=3))
    head, token_ids = tiny_head(loaded, 48, layers)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    hf = loaded.model
    embed, lm_head = hf.get_input_embeddings().weight.detach(), hf.get_output_embeddings().weight.detach()
    features = torch.randn(10, (len(layers) + 1) * hf.config.hidden_size)
    tokens = torch.randint(0, 64, (10,))  # tokens[i] follows i
    anchor, depth = 5, 4
    with torch.no_grad():
        passes = head(features[None], embed[tokens][None], depth)  # depth x [1, 10, hidden]
    drafter = HeadDrafter(make_target(loaded), head, embed, lm_head, token_ids, int8=False)
    drafter.advance(features[: anchor + 1], tokens[: anchor + 1])
    for d in range(1, depth + 1):
        predicted = drafter.decoder.last_hidden[-1:]  # [1, hidden]
        torch.testing.assert_close(predicted[0], passes[d - 1][0, anchor + d - 1], rtol=1e-4, atol=1e-4)
        drafter.step(predicted, tokens[anchor + d : anchor + d + 1])


def random_sequences(loaded: LoadedModel, n: int, length: int, seed: int, layers: tuple[int, ...] = ()) -> list[Sequence]:
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randint(2, 64, (n, length), generator=generator).tolist()
    tokens, final, layer_features = teacher_forced_features(loaded, rows, layers)
    features = torch.cat(([layer_features] if layers else []) + [final], -1)
    return [Sequence(t, f, 0) for t, f in zip(tokens.split(length), features.split(length))]


def test_training_windows_reach_into_the_prompt_and_count_the_answer_only():
    """The head drafts after reading the prompt's last positions, so a training window may start in the
    prompt; its loss counts the positions that predict answer tokens' features only (prompt_length - 2 on)."""
    from specsample.training.dataset import Batcher

    hidden = 4
    seq = Sequence(torch.arange(160), torch.arange(160.0)[:, None].expand(160, hidden).half(), prompt_length=100)
    batcher = Batcher([seq], seq_len=64, batch_size=1, generator=torch.Generator().manual_seed(0))
    starts = set()
    for _ in range(300):
        tokens, features, mask = batcher()
        start = int(tokens[0, 0])
        starts.add(start)
        assert torch.equal(features[0, :, 0].long(), tokens[0])  # each token's own feature row
        counted = (start + torch.nonzero(mask[0]).flatten()).tolist()
        assert counted == list(range(max(start, 98), start + 64))  # positions 98.. predict the answer
    assert min(starts) == 35 and max(starts) == 95  # from one answer position counted to the window at the end


def test_the_estimate_walks_steps_as_the_engine_takes_them():
    """Long steps over an easy stretch are few: the walk weighs them by the steps taken, not by anchors."""
    from specsample.training.objective import walk

    lengths = [5] * 10 + [1] * 10  # 10 easy anchors (4 accepted and the bonus), then 10 hard ones
    assert walk(lengths, 0) == (2 + 10, 10 + 10)  # anchors 0 and 5, then one token a step
    assert walk(lengths, 12) == (8, 8)
    assert sum(lengths) / len(lengths) == 3.0 and walk(lengths, 0)[1] / walk(lengths, 0)[0] < 1.7


def test_the_estimate_counts_greedy_tokens_of_the_whole_vocabulary_on_the_greedy_path():
    """A head whose passes predict every feature exactly: 5 tokens a step at K = 4 on a greedy answer; fewer
    when the target's greedy token is outside the head's subset (it cannot draft it), or when a sampled
    answer leaves the greedy path (the passes after it read a token the engine would not have drafted from)."""
    loaded = tiny_loaded(tiny_llama(64, seed=3))
    head, everything = tiny_head(loaded, 64)
    hf = loaded.model
    embed, lm_head = hf.get_input_embeddings().weight.detach(), hf.get_output_embeddings().weight.detach()
    features = torch.randn(40, head.config.hidden_size, generator=torch.Generator().manual_seed(0))
    greedy = (features @ lm_head.t()).argmax(-1)  # [40], the token each position's state predicts
    tokens = torch.cat([torch.tensor([1]), greedy[:-1]])  # the greedy answer: token i + 1 is greedy[i]

    def estimate(token_ids: torch.Tensor, tokens: torch.Tensor) -> float:
        objective = Objective(head, embed, lm_head, token_ids)
        objective.passes = lambda tokens, features, depth: [features[:, 1:]] * depth  # feature i + 1, exactly
        return objective.accepted_length([Sequence(tokens, features, prompt_length=2)])

    assert estimate(everything, tokens) == 5.0
    commonest = int(greedy.mode().values)
    assert estimate(everything[everything != commonest], tokens) < 5.0
    sampled = tokens.clone()
    sampled[10::8] = (sampled[10::8] + 1) % 64
    assert estimate(everything, sampled) < 5.0


def test_a_head_s_rotary_base_is_its_target_s():
    model = tiny_llama(16, seed=0)
    model.config.rope_parameters = {"rope_type": "default", "rope_theta": 50000.0}
    assert HeadConfig.for_target(tiny_loaded(model)).rope_theta == 50000.0


@pytest.mark.parametrize("layers", [(), (1,)])
def test_training_lowers_the_loss(layers):
    loaded = tiny_loaded(tiny_llama(64, seed=3))
    sequences = random_sequences(loaded, 8, 24, seed=0, layers=layers)
    head, token_ids = tiny_head(loaded, 64, layers)
    hf = loaded.model
    objective = Objective(head.train(), hf.get_input_embeddings().weight.detach(), hf.get_output_embeddings().weight.detach(),
                          token_ids)
    tokens = torch.stack([s.tokens for s in sequences])
    features = torch.stack([s.features.float() for s in sequences])
    mask = torch.ones(tokens.shape[0], tokens.shape[1] - 1, dtype=torch.bool)
    options = TrainOptions()
    optimizer = torch.optim.AdamW(head.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss, _ = objective.loss(tokens, features, mask, options)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.7 * losses[0], losses


@pytest.fixture(scope="module")
def trained_dir(tiny_dir, tmp_path_factory) -> Path:
    """A head trained end to end (generate, features, train, evaluate) for the tiny target."""
    out = tmp_path_factory.mktemp("head")
    prompts = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    prompts.write_text("".join(f"w{i} w{i + 3} w{i + 7}\n" for i in range(2, 30)))
    options = TrainOptions(generate_batch=8, sampled_answers=1, batch_size=4, max_new_tokens=12, vocab_subset=40,
                           steps=6, seq_len=16, eval_every=3, holdout=0.2)  # some of 28 prompts held out
    train(load_model(tiny_dir), [p.turns[0] for p in read_prompts(prompts)], out, options, log=lambda _: None)
    return out


def test_train_writes_a_head_and_a_report(trained_dir):
    config = json.loads((trained_dir / "head.json").read_text())
    assert config["vocab_subset"] == 40
    report = json.loads((trained_dir / "report.json").read_text())
    assert [h["step"] for h in report["history"]] == [3, 6]
    assert report["engine"]["mean_accepted_length"] >= 1.0
    # the positions the loss counted, at most an answer's 12 tokens and its end a window, not the windows' 16
    trained = [h["train_tokens"] for h in report["history"]]
    assert 0 < trained[0] < trained[1] <= 6 * 4 * 13 < 6 * 4 * 16


def test_a_run_with_nothing_held_out_reports_no_held_out_figures(tiny_dir, tmp_path):
    """Data of one prompt leaves none to hold out: its figures are null, and said so, not zeros."""
    options = TrainOptions(generate_batch=2, batch_size=2, max_new_tokens=8, vocab_subset=40, steps=2, seq_len=8,
                           eval_every=2)
    lines = []
    report = train(load_model(tiny_dir), ["w2 w5 w9"], tmp_path, options, log=lines.append)
    assert report["heldout_sequences"] == 0 and report["history"][-1]["heldout_accepted_length_estimate"] is None
    assert report["engine"] == {"prompts": 0, "k": 4, "temperature": 0, "mean_accepted_length": None, "acceptance_rate": None}
    assert any(line.startswith("no prompt held out (1 distinct in the data)") for line in lines)


def test_a_head_trains_on_an_earlier_runs_data_alone(trained_dir, tiny_dir, tmp_path):
    options = TrainOptions(batch_size=4, vocab_subset=40, steps=2, seq_len=16, eval_every=2)
    twice = data_shards(trained_dir) * 2  # the same run given twice (or a run's own OUT): its data once
    report = train(load_model(tiny_dir), [], tmp_path, options, log=lambda _: None, extra_shards=twice)
    assert report["sequences"] == 56 and (tmp_path / "head.json").is_file()
    assert not list((tmp_path / "data").glob("*.safetensors"))  # nothing generated again


def test_resuming_with_options_of_another_head_shape_is_a_clear_error(trained_dir, tiny_dir, tmp_path):
    options = TrainOptions(batch_size=4, vocab_subset=40, steps=2, seq_len=16, eval_every=2)
    train(load_model(tiny_dir), [], tmp_path, options, log=lambda _: None, extra_shards=data_shards(trained_dir))
    with pytest.raises(ValueError, match="holds a head of another shape than these options make"):
        train(load_model(tiny_dir), [], tmp_path, replace(options, steps=4, layers=2), log=lambda _: None,
              extra_shards=data_shards(trained_dir))


def test_a_head_reading_a_middle_layer_trains_on_data_that_lacks_it(trained_dir, tiny_dir, tmp_path):
    """The earlier run's shards get the layer's outputs in copies (the originals stay as they were),
    and the head drafts with them: greedy output is the target's."""
    originals = data_shards(trained_dir)
    before = [shard.read_bytes() for shard in originals]
    options = TrainOptions(batch_size=4, vocab_subset=40, steps=2, seq_len=16, eval_every=2, feature_layers=(1,))
    loaded = load_model(tiny_dir)
    report = train(loaded, [], tmp_path, options, log=lambda _: None, extra_shards=originals)
    assert report["sequences"] == 56 and len(data_shards(tmp_path)) == len(originals)  # a later run can train on them
    assert [shard.read_bytes() for shard in originals] == before
    assert json.loads((tmp_path / "head.json").read_text())["feature_layers"] == [1]
    prompt = load_sequences(originals[:1])[0].tokens[:6]
    outputs = []
    for spec in ("none", f"head:{tmp_path}"):
        target = make_target(loaded)
        steps = decode(target, make_drafter(spec, loaded, target), FixedK(3), prompt, SamplingParams(temperature=0),
                       max_new_tokens=20, eos_token_ids=frozenset(), random=GeneratorSource(torch.Generator().manual_seed(0)),
                       stats=Stats())
        outputs.append([t for step in steps for t in step])
    assert outputs[0] == outputs[1]


def test_feature_layers_must_lie_below_the_final_one_and_be_in_the_data(trained_dir, tiny_dir, tmp_path):
    with pytest.raises(ValueError, match="holds no outputs of layers \\[1\\]: train on its run directory"):
        load_sequences(data_shards(trained_dir), (1,))
    options = TrainOptions(steps=1, feature_layers=(2,))  # the tiny target has 2 layers: the final state is read anyway
    with pytest.raises(ValueError, match=r"layers \[2\] are not all among this target's 1..1"):
        train(load_model(tiny_dir), [], tmp_path, options, log=lambda _: None, extra_shards=data_shards(trained_dir))


def test_sampled_answers_add_a_round_of_other_answers(trained_dir):
    """28 prompts in 4 batches, each answered greedily and once sampled: 8 shards, 56 sequences."""
    greedy = sorted((trained_dir / "data").glob("shard-?????.safetensors"))
    sampled = sorted((trained_dir / "data").glob("shard-?????-s1.safetensors"))
    assert len(greedy) == len(sampled) == 4
    assert json.loads((trained_dir / "report.json").read_text())["sequences"] == 56
    pairs = [(load_sequences([g]), load_sequences([s])) for g, s in zip(greedy, sampled)]
    assert any(not torch.equal(a.tokens, b.tokens) for g, s in pairs for a, b in zip(g, s))


def test_head_loads_for_its_own_target_only(trained_dir, tiny_dir, tiny_draft_dir):
    own = load_model(tiny_dir)
    assert isinstance(make_drafter(f"head:{trained_dir}", own, make_target(own)), HeadDrafter)
    other = load_model(tiny_draft_dir)  # same shapes and vocabulary, other weights
    with pytest.raises(ValueError, match="trained for target"):
        make_drafter(f"head:{trained_dir}", other, make_target(other))


def test_no_shipped_head_for_an_unknown_target(tiny_dir):
    model = load_model(tiny_dir)
    with pytest.raises(ValueError, match="no draft head is shipped"):
        make_drafter("head", model, make_target(model))


TINY_CHAT = "{% for m in messages %}w2 {{ m['content'] }} w1 {% endfor %}{% if add_generation_prompt %}w3 {% endif %}"


def test_the_target_writes_distinct_prompts_and_a_resumed_run_keeps_them(tiny_dir, tmp_path):
    loaded = load_model(tiny_dir)
    loaded.tokenizer.chat_template = TINY_CHAT
    path = tmp_path / "self_prompts.jsonl"
    writer = Writer(loaded, partial(make_target, loaded), 32, "fast")
    first = write_prompts(loaded, writer, path, TrainOptions(self_prompts=6, generate_batch=32, self_prompt_tokens=64))
    assert len(first) == len(set(first)) == 6 and all(first)
    assert all(p.split()[0] != "w2" for p in first)  # the template's opening is not part of a prompt
    more = write_prompts(loaded, writer, path, TrainOptions(self_prompts=9, generate_batch=32, self_prompt_tokens=64))
    assert more[:6] == first and len(set(more)) == 9
    assert [json.loads(line)["prompt"] for line in path.read_text().splitlines()] == more
    # the same writer answers them, outside write_prompts' inference mode, on the slots made inside it
    shards = generate_shards(loaded, writer, more, tmp_path / "data", TrainOptions(generate_batch=32, max_new_tokens=8),
                             model_fingerprint(loaded))
    assert len(shards) == 1


@pytest.mark.parametrize("sampled", [False, True])
def test_the_batched_writer_writes_what_the_target_writes_alone(tiny_dir, sampled):
    """On the target's slots, each prompt's text (greedy, or sampled with its seed) is the one plain
    decoding gives it alone, whatever else shares the batch; transformers' generate, the fallback for a
    target without slots, writes greedy text of the same length limits."""
    loaded = load_model(tiny_dir)
    prompts = [[3 + i, 9, 4 + 2 * i, 7][: 2 + i % 3] for i in range(5)]
    options = TrainOptions(generate_batch=3)
    seeds = seeds_for("test", options) + [11, 12] if sampled else None
    writer = Writer(loaded, partial(make_target, loaded), options.generate_batch, "fast")
    written = writer(prompts, 10, seeds)
    assert writer(prompts[:2], 10, None if seeds is None else seeds[:2]) == written[:2]  # its slots serve again
    params = SamplingParams(temperature=1.0 if sampled else 0.0)
    for i, (prompt, text) in enumerate(zip(prompts, written)):
        alone = decode(make_target(loaded), NoDrafter(), FixedK(0), torch.tensor(prompt), params, max_new_tokens=10,
                       eos_token_ids=loaded.eos_token_ids, random=request_source(None if seeds is None else seeds[i]),
                       stats=Stats())
        assert text == [t for step in alone for t in step]
    if not sampled:
        fallback = Writer(loaded, partial(make_target, loaded, "transformers"), options.generate_batch, "transformers")(prompts, 10, None)
        assert [len(text) for text in fallback] == [len(text) for text in written]


@pytest.mark.parametrize("backend", ["auto", "transformers"])  # on slots, and without them
def test_sampled_data_is_the_same_in_a_run_and_its_resumption(tiny_dir, tmp_path, backend):
    """Seeds come from the run's seed and the shard's name: a shard made again after an interruption
    holds what it held, and another --seed samples other answers."""
    loaded = load_model(tiny_dir)
    prompts = [f"w{i} w{i + 5}" for i in range(2, 8)]
    options = TrainOptions(generate_batch=3, sampled_answers=1, max_new_tokens=12)
    writer = Writer(loaded, partial(make_target, loaded, backend), options.generate_batch, backend_of(loaded, backend))
    shards = generate_shards(loaded, writer, prompts, tmp_path / "a", options, model_fingerprint(loaded))
    assert len(shards) == 4
    before = [load_file(shard)["tokens"] for shard in shards]
    shards[3].unlink()
    again = generate_shards(loaded, writer, prompts, tmp_path / "a", options, model_fingerprint(loaded))
    assert all(torch.equal(a, load_file(b)["tokens"]) for a, b in zip(before, again))
    other = generate_shards(loaded, writer, prompts, tmp_path / "b", replace(options, seed=1), model_fingerprint(loaded))
    assert not torch.equal(before[3], load_file(other[3])["tokens"])


def test_a_resumed_run_writes_the_prompts_an_uninterrupted_one_writes(tiny_dir, tmp_path):
    """Seeds follow from the prompts kept and the batches since the last new one: a run interrupted after a
    batch that added nothing had restarted its count of tries, and every prompt after it differed."""
    import random

    loaded = load_model(tiny_dir)
    loaded.tokenizer.chat_template = TINY_CHAT
    eos = min(loaded.eos_token_ids)

    class SeededWriter:  # what plain decoding with a seed is: a function of the seed alone
        def __init__(self, stop_at: int | None = None) -> None:
            self.calls, self.stop_at = 0, stop_at

        def __call__(self, prompts, max_new_tokens, seeds):
            self.calls += 1
            if self.calls == self.stop_at:
                raise KeyboardInterrupt
            draws = [random.Random(seed) for seed in seeds]
            rows = [[r.choice(range(10, 14)) for _ in range(2)] + ([eos] if r.random() < 0.3 else []) for r in draws]
            return rows

    options = TrainOptions(self_prompts=8, generate_batch=4, self_prompt_tokens=8)
    whole = write_prompts(loaded, SeededWriter(), tmp_path / "a.jsonl", options)
    stops = []
    for stop_at in (2, 3, 4):
        path = tmp_path / f"b{stop_at}.jsonl"
        with pytest.raises(KeyboardInterrupt):
            write_prompts(loaded, SeededWriter(stop_at), path, options)
        stops.append(len(path.read_text().splitlines()) if path.is_file() else 0)
        assert write_prompts(loaded, SeededWriter(), path, options) == whole, stop_at
    assert len(set(stops)) < len(stops)  # some batch added no prompt before an interruption


def test_a_target_without_a_chat_template_cannot_write_prompts(tiny_dir, tmp_path):
    with pytest.raises(ValueError, match="no chat template"):
        loaded = load_model(tiny_dir)
        write_prompts(loaded, Writer(loaded, partial(make_target, loaded), 2, "fast"), tmp_path / "p.jsonl", TrainOptions(self_prompts=2))


def test_train_refuses_self_prompts_without_a_chat_template_before_making_its_directory(tiny_dir, tmp_path):
    out = tmp_path / "head"
    with pytest.raises(ValueError, match="no chat template"):
        train(load_model(tiny_dir), [], out, TrainOptions(self_prompts=2))
    assert not out.exists()


def test_a_run_resumed_with_other_prompts_or_options_is_refused(tiny_dir, tiny_draft_dir, tmp_path):
    """Shards are named by batch: resumed with other prompts, the old shards would be taken for the new; and
    with another target or another backend writing, another model's answers and features."""
    loaded = load_model(tiny_dir)
    writer = Writer(loaded, partial(make_target, loaded), 3, "fast")
    options = TrainOptions(generate_batch=3, max_new_tokens=6)
    prompts = [f"w{i} w{i + 5}" for i in range(2, 5)]
    target = model_fingerprint(loaded)
    made = generate_shards(loaded, writer, prompts, tmp_path, options, target)
    assert generate_shards(loaded, writer, prompts, tmp_path, options, target) == made
    with pytest.raises(ValueError, match=r"holds answers made from other data \(prompts, prompts_sha256 differ\)"):
        generate_shards(loaded, writer, prompts + ["w9 w10"], tmp_path, options, target)
    with pytest.raises(ValueError, match=r"\(max_new_tokens differ\)"):
        generate_shards(loaded, writer, prompts, tmp_path, replace(options, max_new_tokens=7), target)
    other = load_model(tiny_draft_dir)  # the same shapes and vocabulary: its features had been taken silently
    with pytest.raises(ValueError, match=r"\(target differ\)"):
        generate_shards(other, Writer(other, partial(make_target, other), 3, "fast"), prompts, tmp_path, options,
                        model_fingerprint(other))
    with pytest.raises(ValueError, match=r"\(writer differ\)"):
        generate_shards(loaded, Writer(loaded, partial(make_target, loaded, "transformers"), 3, "transformers"), prompts,
                        tmp_path, options, target)
    assert backend_of(loaded, "auto") == "fast"  # --backend auto resumes a --backend fast run: one backend wrote
    manifest = tmp_path / "manifest.json"
    old = {key: value for key, value in json.loads(manifest.read_text()).items() if key not in ("target", "writer")}
    manifest.write_text(json.dumps(old))  # a run of a version that recorded neither: resumed, and both recorded
    assert generate_shards(loaded, writer, prompts, tmp_path, options, target) == made
    assert json.loads(manifest.read_text())["target"] == target
    manifest.write_text(json.dumps({**old, "target": target, "writer": "auto"}))  # --backend as given, as 562abef wrote
    assert generate_shards(loaded, writer, prompts, tmp_path, options, target) == made
    (tmp_path / "failed").mkdir()  # a run that failed before its first shard: its manifest is no data
    (tmp_path / "failed" / "manifest.json").write_text(json.dumps({**old, "writer": "llamacpp"}))
    assert len(generate_shards(loaded, writer, prompts, tmp_path / "failed", options, target)) == len(made)


def test_data_of_another_target_is_refused(trained_dir, tiny_dir, tiny_draft_dir, tmp_path):
    """--extra-data of another model: refused by its manifest where the shapes agree, by its shapes otherwise
    (a traceback deep in training, or silent training on the other model's features)."""
    options = TrainOptions(batch_size=4, vocab_subset=40, steps=1, seq_len=16, eval_every=1)
    with pytest.raises(ValueError, match="holds data of another target"):
        train(load_model(tiny_draft_dir), [], tmp_path, options, log=lambda _: None, extra_shards=data_shards(trained_dir))
    shard = data_shards(trained_dir)[0]
    hidden = load_sequences([shard])[0].features.shape[-1]
    with pytest.raises(ValueError, match=f"{shard} holds data of another model"):
        load_sequences([shard], hidden=hidden + 1, vocab=64)
    with pytest.raises(ValueError, match=f"{shard} holds data of another model"):
        load_sequences([shard], hidden=hidden, vocab=3)


def test_a_finished_run_resumed_with_more_data_keeps_its_token_subset(trained_dir, tiny_dir, tmp_path):
    """A run resumed after its steps were done (more data written since, as `--data-minutes` leaves it) trains
    nothing and says so; the head keeps the token subset its weights were trained for (the subset of the grown
    data had been saved beside the old weights, whose rows then drafted other tokens)."""
    options = TrainOptions(batch_size=4, vocab_subset=20, steps=2, seq_len=16, eval_every=2, holdout=0.0)
    shards = data_shards(trained_dir)
    train(load_model(tiny_dir), [], tmp_path, options, log=lambda _: None, extra_shards=shards[:1])
    before = load_file(tmp_path / "head.safetensors")
    lines = []
    train(load_model(tiny_dir), [], tmp_path, options, log=lines.append, extra_shards=shards)
    after = load_file(tmp_path / "head.safetensors")
    assert any("has trained all 2 steps: nothing to train" in line for line in lines)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    grown = frequent_tokens(load_sequences(shards), 20, 64)
    assert not torch.equal(grown, before["token_ids"])  # the grown data's subset is another one


@pytest.mark.parametrize("damage", ["unknown key", "missing key", "not json", "weights cut short", "weights of another shape"])
def test_a_damaged_head_directory_is_one_clear_error(trained_dir, tiny_dir, tmp_path, damage):
    """A head of another version, or one a kill left half written: a ValueError naming the file, not a traceback."""
    head = tmp_path / "head"
    shutil.copytree(trained_dir, head, ignore=shutil.ignore_patterns("data", "*.pt"))
    config = json.loads((head / "head.json").read_text())
    if damage == "unknown key":
        (head / "head.json").write_text(json.dumps(config | {"extra": 1}))
    elif damage == "missing key":
        (head / "head.json").write_text(json.dumps({k: v for k, v in config.items() if k != "layers"}))
    elif damage == "not json":
        (head / "head.json").write_text("{'layers': 1")
    elif damage == "weights cut short":
        (head / "head.safetensors").write_bytes((head / "head.safetensors").read_bytes()[:100])
    else:
        (head / "head.json").write_text(json.dumps(config | {"intermediate_size": config["intermediate_size"] + 8}))
    model = load_model(tiny_dir)
    with pytest.raises(ValueError, match=r"head\.(json|safetensors)") as error:
        make_drafter(f"head:{head}", model, make_target(model))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04 a zip cut short"])
def test_an_unreadable_checkpoint_is_named(tmp_path, content):
    from specsample.training.train import resume

    path = tmp_path / "checkpoint.pt"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=f"cannot read the checkpoint {path}"):
        resume(path, None, None, torch.Generator())


def test_an_unreadable_data_shard_is_named(tmp_path):
    shard = tmp_path / "shard-00000.safetensors"
    shard.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(ValueError, match=f"cannot read the data shard {shard}"):
        load_sequences([shard])


@pytest.mark.parametrize("content", ["{bad", "[1, 2]"])
def test_an_unreadable_data_manifest_is_named(tmp_path, content):
    from specsample.training.generate import check_extra_data

    (tmp_path / "manifest.json").write_text(content)
    with pytest.raises(ValueError, match=f"cannot read the data manifest {tmp_path / 'manifest.json'}: delete"):
        check_extra_data([tmp_path / "shard-00000.safetensors"], "abc")


def test_a_run_that_writes_nothing_never_makes_the_writers_target(tiny_dir, tmp_path):
    """Shards all made (a resumed run, or data given with --extra-data): no second copy of the weights."""
    loaded = load_model(tiny_dir)
    options = TrainOptions(generate_batch=3, max_new_tokens=6)
    prompts = [f"w{i} w{i + 5}" for i in range(2, 5)]
    target = model_fingerprint(loaded)
    made = generate_shards(loaded, Writer(loaded, partial(make_target, loaded), 3, "fast"), prompts, tmp_path, options,
                           target)

    def refuse() -> None:
        raise AssertionError("the writer's target was made")

    assert generate_shards(loaded, Writer(loaded, refuse, 3, "fast"), prompts, tmp_path, options,
                           target) == made


def test_held_out_split_keeps_every_answer_to_a_prompt_on_one_side():
    """Answers to one prompt share much of their text: split by sequence, the held-out figures would
    reward a head for memorising the other answers."""
    sequences = [
        Sequence(torch.tensor([prompt, prompt + 1, 100 + answer]), torch.zeros(3, 4), prompt_length=2)
        for prompt in range(0, 40, 2) for answer in range(4)
    ]
    train_set, eval_set = split(sequences, holdout=0.25, seed=0)
    prompts = [{int(s.tokens[0]) for s in part} for part in (train_set, eval_set)]
    assert len(train_set) + len(eval_set) == len(sequences)
    assert not prompts[0] & prompts[1]
    assert 1 <= len(prompts[1]) <= 12 and len(eval_set) == 4 * len(prompts[1])


def test_a_prompt_is_held_out_by_its_own_hash_alone():
    """No fallback that holds out the lowest hash of few prompts: grown from one prompt to three, a run
    would hold out the one it trained on. Data whose every prompt falls in the held-out share is refused."""
    def data(prompts) -> list[Sequence]:
        return [Sequence(torch.tensor([p, p + 1, 7]), torch.zeros(3, 4), prompt_length=2) for p in prompts]

    held = [p for p in range(0, 400, 2) if prompt_hash((p, p + 1), 0) < 0.05]
    kept = [p for p in range(0, 400, 2) if p not in held][:3]
    assert split(data(kept), holdout=0.05, seed=0)[1] == []  # none below: none held out
    with pytest.raises(ValueError, match=r"every prompt of the data \(1\) falls in the held-out share"):
        split(data(held[:1]), holdout=0.05, seed=0)
    train_set, eval_set = split(data(held[:1] + kept), holdout=0.05, seed=0)
    assert len(train_set) == 3 and len(eval_set) == 1


def test_unroll_beyond_the_window_is_refused():
    with pytest.raises(ValueError, match=r"unroll \(3\) must be at most seq_len \(2\)"):
        TrainOptions(seq_len=2, unroll=3)


def test_layer_features_of_two_runs_with_the_same_names_stay_apart(trained_dir, tiny_dir, tmp_path):
    """--extra-data a/run --extra-data b/run: their shards share names; each copy with layer features is
    its own source's."""
    import shutil

    from specsample.training.generate import with_layer_features

    for name in "ab":
        shutil.copytree(trained_dir / "data", tmp_path / name / "run" / "data")
    first = data_shards(tmp_path / "a" / "run")[:1]
    (tmp_path / "b" / "run" / "data" / first[0].name).write_bytes(data_shards(trained_dir)[1].read_bytes())
    shards = first + [tmp_path / "b" / "run" / "data" / first[0].name]
    (tmp_path / "out").mkdir()
    copies = with_layer_features(load_model(tiny_dir), shards, (1,), tmp_path / "out")
    assert len(set(copies)) == 2
    assert not torch.equal(load_file(copies[0])["tokens"], load_file(copies[1])["tokens"])


def test_held_out_split_keeps_its_sides_as_the_data_grows():
    """A run resumed on more data: no prompt trained on before is held out now, nor the other way round;
    over 2,000 prompts about the asked share is held out."""
    def data(prompts: int) -> list[Sequence]:
        return [Sequence(torch.tensor([p, p + 1, 7]), torch.zeros(3, 4), prompt_length=2) for p in range(0, 2 * prompts, 2)]

    def sides(prompts: int) -> tuple[set[int], set[int]]:
        train_set, eval_set = split(data(prompts), holdout=0.1, seed=3)
        return {int(s.tokens[0]) for s in train_set}, {int(s.tokens[0]) for s in eval_set}

    trained, held = sides(200)
    trained_more, held_more = sides(2000)
    assert trained <= trained_more and held <= held_more
    assert 150 <= len(held_more) <= 250


def test_saved_head_round_trips(tmp_path):
    loaded = tiny_loaded(tiny_llama(64, seed=3))
    head, token_ids = tiny_head(loaded, 20)
    save_head(tmp_path, head, token_ids)
    drafter = HeadDrafter.load(loaded, make_target(loaded), tmp_path)
    assert torch.equal(drafter.token_ids, token_ids)


@pytest.mark.parametrize("options, message", [
    (dict(lr=float("nan")), "lr must be a finite number > 0, got nan"),
    (dict(lr=0.0), "lr must be a finite number > 0"),
    (dict(distill_weight=float("inf")), "distill_weight must be a finite number >= 0"),
    (dict(feature_weight=-1.0), "feature_weight must be a finite number >= 0"),
    (dict(data_minutes=float("nan")), "data_minutes must be a finite number >= 0"),
])
def test_training_options_that_would_fail_after_the_data_is_made_are_refused_first(options, message):
    with pytest.raises(ValueError, match=message):
        TrainOptions(**options)
