"""The server with continuous batching (`--max-batch`, server/scheduler.py), over loopback HTTP with the
official `openai` client: every response is the one its request gets alone, under load too; each
request ends on its own; a client that leaves frees its slot; 400, 503 and the API key as without
batching; /metrics counts requests and rows per step."""

from __future__ import annotations

import itertools
import json
import random
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from specsample import SpecSampler
from specsample.cli import main
from specsample.server import create_app

from conftest import needs_kernels
from test_server import BAD_REQUESTS, PROMPT, generated_tokens, long_dir, metrics, outcome_count, serving, stream_text, wait_for  # noqa: F401
from test_server import test_a_prompt_that_fills_the_window_without_max_tokens_names_no_max_tokens  # noqa: F401  the batch's default too

pytestmark = needs_kernels
MAX_BATCH = 8


@pytest.fixture(scope="module")
def sampler(tiny_dir) -> SpecSampler:
    return SpecSampler.load(str(tiny_dir), "suffix", backend="fast")


@pytest.fixture(scope="module")
def base_url(sampler) -> Iterator[str]:
    with serving(create_app(sampler, k=3, max_queue=64, max_batch=MAX_BATCH)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def request_of(i: int) -> dict:
    """Request i of the load test: its own prompt, length, stop string and temperature (greedy, or seeded)."""
    rng = random.Random(i)
    prompt = " ".join(f"w{rng.randrange(2, 64)}" for _ in range(rng.randrange(1, 12)))
    options = dict(max_tokens=rng.randrange(1, 40), temperature=0 if i % 3 else 1.0, seed=i)
    return dict(prompt=prompt, **options, **({"stop": [f"w{rng.randrange(2, 64)}"]} if i % 4 == 0 else {}))


def alone(sampler: SpecSampler, request: dict) -> str:
    return sampler.generate(request["prompt"], max_new_tokens=request["max_tokens"], temperature=request["temperature"],
                            seed=request["seed"], stop=request.get("stop", ()), chat=False, k=3).text


@pytest.mark.parametrize("stream", [False, True])
def test_completions_match_generate(client, sampler, stream):
    expected = sampler.generate(PROMPT, max_new_tokens=12, temperature=0, chat=False, k=3)
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stream=stream)
    text, last = stream_text(response) if stream else (response.choices[0].text, response)
    assert text == expected.text
    assert last.usage.completion_tokens == len(expected.token_ids)
    speculative = last.model_extra["speculative"]
    assert speculative["drafter"] == "suffix" and speculative["steps"] >= 1
    assert speculative["accepted_tokens"] <= speculative["drafted_tokens"]  # the suffix tree learns: counts vary


def test_chat_matches_generate(client, sampler):
    messages = [{"role": "user", "content": "w5 w9"}]
    expected = sampler.generate(messages, max_new_tokens=6, temperature=0, k=3)
    text, _ = stream_text(client.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                                          temperature=0, stream=True))
    assert text == expected.text


def test_load_32_streaming_clients_200_requests(client, sampler, base_url):
    """32 concurrent streaming clients send 200 requests of different prompts, lengths, stop strings and
    temperatures: no errors, and each response is its request's alone (greedy, or seeded)."""
    requests = [request_of(i) for i in range(200)]
    expected = [alone(sampler, r) for r in requests]
    steps_before = metrics(base_url).get(("specsample_batch_size_count", ()), 0)

    def run(request: dict) -> str:
        return stream_text(client.completions.create(model="tiny", stream=True, **request))[0]

    start = time.monotonic()
    with ThreadPoolExecutor(32) as pool:
        futures = [pool.submit(run, r) for r in requests]
        results = [future.result(timeout=600) for future in futures]
    assert time.monotonic() - start < 600
    mixed = [i for i, (got, want) in enumerate(zip(results, expected)) if got != want]
    assert not mixed, f"{len(mixed)} responses differ from their request alone, first {requests[mixed[0]]}"
    samples = metrics(base_url)
    steps = samples[("specsample_batch_size_count", ())] - steps_before
    assert steps > 0 and samples[("specsample_rows_per_step_sum", ())] >= samples[("specsample_batch_size_sum", ())]
    assert samples[("specsample_batch_size_sum", ())] / samples[("specsample_batch_size_count", ())] > 1  # batched
    assert samples[("specsample_queue_depth", ())] == 0
    assert samples[("specsample_prefill_seconds_total", ())] > 0  # the batch's prefills are counted too


@pytest.mark.parametrize("path, body", BAD_REQUESTS)
def test_bad_request_is_400(base_url, path, body):
    content = body if isinstance(body, str) else json.dumps(body)
    response = httpx.post(base_url + path, content=content, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"


@pytest.fixture(scope="module")
def small_server(long_dir) -> Iterator[str]:  # noqa: F811
    """Two slots, two places in the queue, an API key, and generations long enough to leave."""
    sampler = SpecSampler.load(str(long_dir), "ngram", backend="fast")
    with serving(create_app(sampler, max_queue=2, api_key="secret", max_batch=2, k=2)) as url:
        yield url, sampler


def sse_text(lines: Iterator[str]) -> str:
    """The text of a completions stream read to its end."""
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]
    return "".join(choice["text"] for chunk in chunks for choice in chunk["choices"])


def test_disconnect_frees_the_slot_and_the_others_go_on(small_server):
    """Both slots hold a stream of thousands of tokens, each seen started, so a third request meets a full
    queue whatever the timing; the first client leaves, and the second stream ends as it would alone."""
    url, sampler = small_server
    auth = {"Authorization": "Bearer secret"}
    long_request = {"prompt": PROMPT, "max_tokens": 3000, "temperature": 0, "stream": True}
    other = {"prompt": "w7 w3 w12", "max_tokens": 3000, "temperature": 0, "stream": True}
    expected = sampler.generate(other["prompt"], max_new_tokens=3000, temperature=0, chat=False, k=2)
    assert len(expected.token_ids) > 1000  # it outlasts the few steps below by far
    cancelled, generated = outcome_count(url, "cancelled"), generated_tokens(url)
    with httpx.Client(base_url=url, headers=auth, timeout=120) as http:
        with http.stream("POST", "/v1/completions", json=other) as running:
            running_lines = running.iter_lines()
            with http.stream("POST", "/v1/completions", json=long_request) as response:
                assert response.status_code == 200 and running.status_code == 200
                lines = response.iter_lines()  # held: dropping the iterator would close the connection
                assert json.loads(next(line for line in lines if line.startswith("data: "))[6:])["choices"][0]["text"]
                first = next(line for line in running_lines if line.startswith("data: "))
                busy = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
                assert busy.status_code == 503 and busy.json()["error"]["code"] == "queue_full"
            wait_for(lambda: outcome_count(url, "cancelled") == cancelled + 1)
            assert sse_text(itertools.chain([first], running_lines)) == expected.text
        wait_for(lambda: metrics(url)[("specsample_queue_depth", ())] == 0)
        assert generated_tokens(url) == generated + len(expected.token_ids)  # the cancelled one never finished
        served = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0})
        assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 3
    assert httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT}).status_code == 401


@pytest.mark.parametrize("args, message", [
    (["--max-batch", "0"], "max_batch"),
    (["--max-batch", "2", "--drafter", "quantized", "--backend", "fast"], "batched decoding drafts with drafters that fork"),
    (["--max-batch", "2", "--backend", "transformers"], "batched decoding needs a target backend"),
])
def test_serve_max_batch_bad_arguments(capsys, tiny_dir, args, message, monkeypatch):
    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda app, **options: None)
    with pytest.raises(SystemExit) as done:
        main(["serve", "--model", str(tiny_dir), *args])
    err = capsys.readouterr().err
    assert done.value.code == 2 and len(err.strip().splitlines()) == 1 and message in err


def test_default_max_tokens_fills_the_context_window(client, sampler):
    expected = sampler.generate(PROMPT, max_new_tokens=sampler.target.max_length - 4, temperature=0, chat=False, k=3)
    response = client.completions.create(model="tiny", prompt=PROMPT, temperature=0)
    assert response.usage.completion_tokens == len(expected.token_ids)
    assert response.choices[0].text == expected.text and response.choices[0].finish_reason == expected.finish_reason


@pytest.fixture(scope="module")
def longest_dir(long_dir, tmp_path_factory) -> Path:  # noqa: F811
    """The tiny target with an 8,192-token context (the fast backend's most): two streams of 8,000 tokens run
    for seconds (2.6 s alone on an idle AMD EPYC), several times what the test needs them to last."""
    directory = tmp_path_factory.mktemp("tiny-longest") / "model"
    shutil.copytree(long_dir, directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 8192}))
    return directory


@pytest.mark.parametrize("max_batch", [1, 2])
def test_a_waiting_request_whose_client_leaves_frees_its_place(longest_dir, max_batch):
    """One place more than slots (one at a time, or a batch of two): that many long streams run, another
    request waits; its client gives up before it starts, and its place is free again while the streams
    still run (the one-at-a-time worker once kept it until the streams ended, refusing others with 503)."""
    sampler = SpecSampler.load(str(longest_dir), "none", backend="fast")
    with serving(create_app(sampler, max_queue=max_batch + 1, max_batch=max_batch, k=0)) as url:
        long_request = {"prompt": PROMPT, "max_tokens": 8000, "temperature": 0, "stream": True}
        with ExitStack() as streams:
            for _ in range(max_batch):
                client = streams.enter_context(httpx.Client(base_url=url, timeout=120))
                streams.enter_context(client.stream("POST", "/v1/completions", json=long_request))
            wait_for(lambda: metrics(url)[("specsample_queue_depth", ())] == max_batch)
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=0.3)
            wait_for(lambda: outcome_count(url, "cancelled") == 1)
            assert metrics(url)[("specsample_queue_depth", ())] == max_batch  # the streams still run
        wait_for(lambda: metrics(url)[("specsample_queue_depth", ())] == 0)


def test_a_failure_outside_a_step_fails_its_requests_and_the_batch_goes_on(sampler, monkeypatch):
    """A failure past one request's own (here turning a step's tokens into text) once ended the batch
    thread, and every later request waited for ever. Now the running requests get the error, their streams
    end with [DONE], and the next request is answered."""
    from specsample.api import TextOutput

    feed, calls = TextOutput.feed, []

    def failing_once(self, new):  # at the second step: the stream has started
        calls.append(new)
        if len(calls) == 2:
            raise RuntimeError("a failure past one request's own")
        return feed(self, new)

    monkeypatch.setattr(TextOutput, "feed", failing_once)
    with serving(create_app(sampler, max_batch=2, k=0)) as url:
        body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert "a failure past one request's own" in lines[-2] and lines[-1] == "data: [DONE]"
        answer = httpx.post(f"{url}/v1/completions", json={**body, "stream": False}, timeout=60)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
