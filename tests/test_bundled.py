"""End to end on the bundled SmolLM2-135M-Instruct: greedy identity, GGUF path, the README example."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from specsample import SpecSampler
from specsample.drafters import DraftModelDrafter
from specsample.models import TransformersTarget, make_target
from specsample.models.loading import bundled_gguf, conversion_dir, load_model

pytestmark = pytest.mark.slow

PROMPTS = ["What is the capital of France?", "Write a short poem about autumn leaves."]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def bundled():
    return load_model()


def hf_greedy(loaded, ids: list[int]) -> list[int]:
    out = loaded.model.generate(
        torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=loaded.tokenizer.pad_token_id,
    )
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_matches_transformers_generate(bundled, prompt):
    fast = SpecSampler(bundled, make_target(bundled), DraftModelDrafter(TransformersTarget(bundled.model)))
    expected = hf_greedy(bundled, fast.encode(prompt))
    assert fast.generate(prompt, temperature=0, max_new_tokens=NEW_TOKENS, k=3).token_ids == expected
    plain = SpecSampler(bundled, TransformersTarget(bundled.model), DraftModelDrafter(make_target(bundled)))
    assert plain.generate(prompt, temperature=0, max_new_tokens=NEW_TOKENS, k=0).token_ids == expected


def test_chat_template_is_applied(bundled):
    sampler = SpecSampler(bundled, make_target(bundled), DraftModelDrafter(make_target(bundled)))
    ids = sampler.encode("hello")
    assert bundled.tokenizer.decode(ids).startswith("<|im_start|>system")
    assert sampler.encode("hello", chat=False) == bundled.tokenizer.encode("hello")


def test_a_gguf_file_loads_by_path(bundled):
    loaded = load_model(bundled_gguf())
    assert loaded.name == str(bundled_gguf())
    assert loaded.model.config.num_hidden_layers == 30 and loaded.model.config.vocab_size == 49152


def test_readme_python_example_runs():
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    block = re.search(r"## Python API\n\n```python\n(.*?)```", readme, re.S).group(1)
    block = block.replace("max_new_tokens=48", "max_new_tokens=8").replace("max_new_tokens=40", "max_new_tokens=8")
    exec(compile(block, "README.md", "exec"), {})


def test_a_gguf_file_is_cached_by_content_not_by_path(tmp_path):
    """The bundled file copied elsewhere (another install) keeps its cache entry; a byte
    changed in its last MiB, or a different size, gives another (the key of path and
    modification time made a 0.5 GB conversion per install)."""
    source = bundled_gguf()
    copy = tmp_path / source.name
    shutil.copyfile(source, copy)
    assert conversion_dir(copy) == conversion_dir(source)
    with copy.open("r+b") as file:
        file.seek(-10, 2)
        last = file.read(1)
        file.seek(-10, 2)
        file.write(bytes([last[0] ^ 1]))
    assert conversion_dir(copy) != conversion_dir(source)
    short = tmp_path / "short" / source.name
    short.parent.mkdir()
    short.write_bytes(source.read_bytes()[:-1])
    assert conversion_dir(short) != conversion_dir(source)


def test_a_copy_under_another_name_finds_the_conversion_and_a_header_edit_past_a_mib_does_not(tmp_path):
    """The bundled file's header is 1.7 MB (its vocabulary): a fixed first MiB missed edits past it."""
    source = bundled_gguf()
    renamed = tmp_path / "renamed.gguf"
    shutil.copyfile(source, renamed)
    link = tmp_path / "link.gguf"
    link.symlink_to(source)
    assert conversion_dir(renamed) == conversion_dir(link) == conversion_dir(source)
    with renamed.open("r+b") as file:
        at = 1_500_000 + file.read(1_600_000)[1_500_000:].index(b"ing") + 2  # a token's text, in the vocabulary
        file.seek(at)
        file.write(b"G")
    assert conversion_dir(renamed) != conversion_dir(source)


def test_a_prompt_of_one_token_decodes_on_the_bundled_blocks():
    """An empty prefill (the prompt's only token is scored by the first pass) reads no row of the tied
    embedding, whose GGUF blocks once failed to unpack zero rows: every one-word completion on the default
    backend was an error."""
    sampler = SpecSampler.load(None, "none", backend="gguf")
    assert len(sampler.encode("Hi", chat=False)) == 1
    alone = sampler.generate("Hi", chat=False, temperature=0, max_new_tokens=6)
    assert len(alone.token_ids) == 6
    target = sampler.target
    target.prefill(torch.tensor([], dtype=torch.long))
    first = target.score(torch.tensor(sampler.encode("Hi", chat=False)))
    assert first.shape == (1, target.vocab_size) and int(first[0].argmax()) == alone.token_ids[0]


def test_a_whitespace_prompt_is_a_prompt():
    """Whitespace is text a raw completion can continue (OpenAI's API takes it); only "" is refused."""
    sampler = SpecSampler.load(None, "none", backend="gguf")
    assert sampler.encode(" \n\t ", chat=False)
    assert len(sampler.generate(" \n\t ", chat=False, temperature=0, max_new_tokens=3).token_ids) == 3
