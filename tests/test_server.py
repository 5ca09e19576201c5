"""The OpenAI-compatible server, end to end over loopback HTTP with the official `openai` client."""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from specsample import SpecSampler
from specsample.cli import main
from specsample.server import create_app

PROMPT = "w5 w9 w7 w3"
K = 3


@contextmanager
def serving(app) -> Iterator[str]:
    """Run `app` with uvicorn on a free loopback port in a background thread; yield its base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                           timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module")
def sampler(tiny_dir, tiny_draft_dir) -> SpecSampler:
    return SpecSampler.load(str(tiny_dir), str(tiny_draft_dir), backend="transformers")


@pytest.fixture(scope="module")
def base_url(sampler) -> Iterator[str]:
    with serving(create_app(sampler, k=K, max_queue=32)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def long_dir(tiny_dir, tmp_path_factory) -> Path:
    """The tiny target with a 4096-token context: greedy decoding runs 2000 tokens without EOS."""
    directory = tmp_path_factory.mktemp("tiny-long") / "model"
    shutil.copytree(tiny_dir, directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    return directory


@pytest.fixture(scope="module")
def small_server(long_dir) -> Iterator[str]:
    """One place in the queue, an API key, and generations long enough to disconnect from."""
    sampler = SpecSampler.load(str(long_dir), backend="transformers")
    with serving(create_app(sampler, max_queue=1, api_key="secret")) as url:
        yield url


def cli_generate(capsys, *args: str) -> dict:
    try:
        main(["generate", *args, "--json"])
    except SystemExit as done:
        assert not done.code, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def metrics(base_url: str, headers: dict | None = None) -> dict[tuple, float]:
    """Every sample of /metrics: (name, sorted labels) -> value."""
    text = httpx.get(f"{base_url}/metrics", headers=headers).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def outcome_count(base_url: str, outcome: str) -> float:
    return sum(v for (name, labels), v in metrics(base_url).items()
               if name == "specsample_requests_total" and ("outcome", outcome) in labels)


def generated_tokens(base_url: str) -> float:
    return metrics(base_url)[("specsample_generated_tokens_total", ())]


def stream_text(stream) -> tuple[str, object]:
    """The text of a stream of chunks, and its last chunk."""
    text, last = "", None
    for chunk in stream:
        choice = chunk.choices[0]
        text += (choice.delta.content or "") if hasattr(choice, "delta") else choice.text
        last = chunk
    return text, last


def check_blocks(obj, completion_tokens: int) -> None:
    """The usage and speculative blocks of a response or of a stream's last chunk."""
    assert obj.usage.prompt_tokens == 4
    assert obj.usage.completion_tokens == completion_tokens
    assert obj.usage.total_tokens == 4 + completion_tokens
    speculative = obj.model_extra["speculative"]
    assert speculative["drafted_tokens"] > 0
    assert 0 <= speculative["acceptance_rate"] <= 1
    assert speculative["mean_accepted_length"] >= 1


@pytest.mark.parametrize("stream", [False, True])
def test_completions_match_generate(capsys, client, tiny_dir, tiny_draft_dir, stream):
    expected = cli_generate(capsys, PROMPT, "--model", str(tiny_dir), "--drafter", str(tiny_draft_dir),
                            "--k", str(K), "--backend", "transformers", "--no-chat", "--temperature", "0",
                            "--max-new-tokens", "12")
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stream=stream)
    if stream:
        text, last = stream_text(response)
    else:
        text, last = response.choices[0].text, response
    assert text == expected["text"]
    assert last.choices[0].finish_reason == expected["finish_reason"]
    check_blocks(last, len(expected["token_ids"]))


@pytest.mark.parametrize("stream", [False, True])
def test_chat_completions_match_generate(capsys, client, tiny_dir, stream):
    expected = cli_generate(capsys, PROMPT, "--model", str(tiny_dir), "--backend", "transformers",
                            "--temperature", "0", "--max-new-tokens", "10")
    messages = [{"role": "user", "content": PROMPT}]
    response = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                              stream=stream)
    if stream:
        text, last = stream_text(response)
    else:
        text, last = response.choices[0].message.content, response
        assert response.choices[0].message.role == "assistant"
    assert text == expected["text"]
    assert last.choices[0].finish_reason == expected["finish_reason"]
    check_blocks(last, len(expected["token_ids"]))


def test_stop_seed_and_top_p_as_the_library(client, sampler):
    words = sampler.generate(PROMPT, max_new_tokens=12, temperature=0, chat=False).text.split()
    stop = words[4]
    expected = sampler.generate(PROMPT, max_new_tokens=12, temperature=0, chat=False, stop=[stop])
    assert sampler.generate(PROMPT, max_new_tokens=12, temperature=0, chat=False, stop=stop).text == expected.text  # one string
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stop=stop)
    assert response.choices[0].text == expected.text and stop not in expected.text
    assert response.choices[0].finish_reason == "stop"
    options = dict(max_new_tokens=16, temperature=0.9, top_p=0.95, seed=11, chat=False, k=K)
    expected = sampler.generate(PROMPT, **options)
    for _ in range(2):
        response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0.9,
                                             top_p=0.95, seed=11)
        assert response.choices[0].text == expected.text


def test_a_prediction_changes_the_speed_not_the_text(client, sampler):
    """OpenAI's Predicted Outputs: the prediction (a string or text parts) is drafted from first; the answer
    is the one without it, here the prediction itself, a wrong one, streamed or not."""
    expected = sampler.generate(PROMPT, max_new_tokens=12, temperature=0, chat=False).text
    for prediction in (expected, [{"type": "text", "text": expected}], "w1 w2 w3 w4 w5"):
        response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                             extra_body={"prediction": {"type": "content", "content": prediction}})
        assert response.choices[0].text == expected
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w5 w6"}], max_tokens=12,
                                          temperature=0, prediction={"type": "content", "content": expected}, stream=True)
    text, _ = stream_text(chat)
    assert text == client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w5 w6"}],
                                                  max_tokens=12, temperature=0).choices[0].message.content


def test_default_max_tokens_fills_the_context_window(client, sampler):
    response = client.completions.create(model="tiny", prompt=PROMPT, temperature=0)  # greedy: no EOS here
    assert response.usage.completion_tokens == sampler.target.max_length - 4
    assert response.choices[0].finish_reason == "length"


def test_models_health_and_metrics(base_url, client, tiny_dir):
    assert [m.id for m in client.models.list()] == [str(tiny_dir)]
    assert httpx.get(f"{base_url}/health").json() == {"status": "ok"}
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0)
    samples = metrics(base_url)
    assert outcome_count(base_url, "completed") >= 1
    assert samples[("specsample_generated_tokens_total", ())] >= 6
    assert samples[("specsample_drafted_tokens_total", ())] >= samples[("specsample_accepted_tokens_total", ())]
    assert 0 <= samples[("specsample_acceptance_rate", ())] <= 1
    assert samples[("specsample_mean_accepted_length", ())] >= 1
    assert samples[("specsample_request_duration_seconds_count", ())] >= 1
    assert samples[("specsample_time_to_first_token_seconds_count", ())] >= 1
    assert samples[("specsample_prefill_seconds_total", ())] > 0


def test_sixteen_concurrent_streams_do_not_mix(client, sampler):
    prompts = [f"w{3 + i} w{20 + 2 * i} w{9 + i}" for i in range(16)]
    expected = [sampler.generate(p, max_new_tokens=8, temperature=0, chat=False).text for p in prompts]

    def run(prompt: str) -> str:
        stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, stream=True)
        return stream_text(stream)[0]

    with ThreadPoolExecutor(16) as pool:
        results = [future.result(timeout=120) for future in [pool.submit(run, p) for p in prompts]]
    assert results == expected


TOO_LONG = " ".join(["w5"] * 200)  # beyond the tiny target's 128-token context
BAD_REQUESTS = [
    ("/v1/completions", '{"prompt": "w5", '),
    ("/v1/completions", "[" * 100_000),  # JSON too deep to parse: starlette's HTTPException, counted as invalid too
    ("/v1/completions", "[1, 2]"),
    ("/v1/completions", {}),
    ("/v1/completions", {"prompt": 5}),
    ("/v1/completions", {"prompt": ""}),
    ("/v1/completions", {"prompt": ["w5", "w6"]}),
    ("/v1/completions", {"prompt": "w5", "temperature": "hot"}),
    ("/v1/completions", {"prompt": "w5", "temperature": -0.5}),
    ("/v1/completions", '{"prompt": "w5", "temperature": Infinity}'),  # Python's json reads it
    ("/v1/completions", {"prompt": "w5", "top_p": 0}),
    ("/v1/completions", {"prompt": "w5", "top_p": 1.5}),
    ("/v1/completions", {"prompt": "w5", "max_tokens": 0}),
    ("/v1/completions", {"prompt": "w5", "max_tokens": 2.5}),
    ("/v1/completions", {"prompt": "w5", "max_tokens": 1000}),
    ("/v1/completions", {"prompt": "w5", "n": 2}),
    ("/v1/completions", {"prompt": "w5", "stream": "yes"}),
    ("/v1/completions", {"prompt": "w5", "stop": 5}),
    ("/v1/completions", {"prompt": "w5", "stop": ""}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w5"}], "stop": ["w6", ""]}),
    ("/v1/completions", {"prompt": "w5", "seed": "x"}),
    ("/v1/completions", {"prompt": TOO_LONG, "max_tokens": 1}),
    ("/v1/completions", {"prompt": TOO_LONG, "stream": True}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"prompt": "w5"}),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "w5"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}),
    ("/v1/chat/completions", {"messages": "w5"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": TOO_LONG}], "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "w7"}, {"role": "user", "content": "w5"}]}),  # no template
    # OpenAI options this server does not implement, turned on (`schemas.UNSUPPORTED`)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w5"}], "logprobs": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w5"}], "frequency_penalty": 0.5}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w5"}], "response_format": {"type": "json_object"}}),
    ("/v1/completions", {"prompt": "w5", "logprobs": 2}),
    ("/v1/completions", {"prompt": "w5", "echo": True}),
    ("/v1/completions", {"prompt": "w5", "logit_bias": {"5": 100}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w5"}], "tool_choice": "required"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w5"}], "modalities": ["text", "audio"]}),
    ("/v1/completions", {"prompt": "w5", "ignore_eos": True}),  # vLLM's extensions
    ("/v1/completions", {"prompt": "w5", "min_tokens": 30}),
    ("/v1/completions", {"prompt": "w5", "stop_token_ids": [13]}),
    ("/v1/completions", {"prompt": "w5", "stop": "w6", "include_stop_str_in_output": True}),
    ("/v1/completions", {"prompt": "w5", "guided_json": {"type": "object"}}),
    ("/v1/completions", {"prompt": "w5", "structured_outputs": {"choice": ["w6", "w7"]}}),  # vLLM's newer name
    ("/v1/completions", {"prompt": "w5", "bad_words": ["w6"]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w5"}], "continue_final_message": True}),
    ("/v1/completions", {"prompt": "w5", "repeat_penalty": 1.3}),  # llama.cpp's names
    ("/v1/completions", {"prompt": "w5", "grammar": "root ::= \"w6\""}),
    ("/v1/completions", {"prompt": "w5", "n_predict": 3}),
    ("/v1/completions", {"prompt": "w5", "stream_options": {"include_usage": True}}),  # without stream
    ("/v1/completions", {"prompt": "w5", "prediction": {"type": "image", "content": "w6"}}),  # Predicted Outputs' kind
    ("/v1/completions", {"prompt": "w5", "prediction": "w6"}),
    ("/v1/completions", {"prompt": "w5", "logprobs": 0}),  # text completions' 0: the sampled tokens' log probabilities
    ("/v1/completions", {"prompt": "w5", "prediction": {"type": "content", "content": "w6 " * 1000}}),  # past the window
    # a lone surrogate (valid JSON, not valid UTF-8 text)
    ("/v1/completions", '{"prompt": "w5 \\ud800 w9"}'),
    ("/v1/completions", '{"prompt": "w5", "prediction": {"type": "content", "content": "w6 \\ud800"}}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "w5 \\ud800"}]}'),
    ("/v1/completions", '{"prompt": "w5", "stop": ["w7", "\\udfff"]}'),  # a stop string no answer can hold
]


@pytest.mark.parametrize("path, body", BAD_REQUESTS)
def test_bad_request_is_400_and_the_server_keeps_serving(base_url, client, path, body):
    content = body if isinstance(body, str) else json.dumps(body)
    before = outcome_count(base_url, "invalid")
    response = httpx.post(base_url + path, content=content, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    assert outcome_count(base_url, "invalid") == before + 1
    assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0).choices[0].text


@pytest.mark.parametrize(("body", "message"), [
    (b'{"prompt": "w5 \xff"}', "the body is not UTF-8 text: byte 0xff at 15"),
    (b'{"prompt": "w5", "max_tokens": 1' + b"0" * 5000 + b"}", "the body cannot be read as JSON: Exceeds the limit"),
    (b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}", "the body's JSON is nested too deeply"),
])
def test_a_body_that_cannot_be_read_is_named(base_url, body, message):
    """Bodies FastAPI cannot parse (its own message: "There was an error parsing the body"): what is wrong."""
    response = httpx.post(base_url + "/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["message"].startswith(message), response.text


@pytest.mark.parametrize(("content", "message"), [
    ([{"type": "text", "text": "w5"}, {"type": "image_url", "image_url": {"url": "data:,"}}],
     "messages.0: content parts of type 'image_url' are not supported: this server takes text only"),
    ([{"type": "refusal", "refusal": "no"}], "content parts of type 'refusal' are not supported"),
    (None, "messages.0: content must be a string or a list of text parts, got None"),
    ([{"type": "text"}], "messages.0: a text part needs its text as a string, got None"),
])
def test_content_that_is_not_text_is_named(base_url, content, message):
    response = httpx.post(base_url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": content}]})
    assert response.status_code == 400 and message in response.json()["error"]["message"], response.text


def test_a_prompt_that_fills_the_window_without_max_tokens_names_no_max_tokens(base_url, sampler):
    words = ["w5"] * sampler.target.max_length
    while len(sampler.encode(" ".join(words), False)) > sampler.target.max_length:
        words.pop()
    response = httpx.post(base_url + "/v1/completions", json={"prompt": " ".join(words)})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "leaves no room for new tokens" in message and "max_new_tokens" not in message


def test_usage_in_a_chunk_of_its_own_with_include_usage(client):
    """OpenAI's stream_options.include_usage: the finish chunk, then one with no choices and the usage."""
    options = dict(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, stream=True)
    plain = list(client.completions.create(**options))
    chunks = list(client.completions.create(**options, stream_options={"include_usage": True}))
    assert len(chunks) == len(plain) + 1
    finish, last = chunks[-2], chunks[-1]
    assert finish.choices[0].finish_reason == "length" and finish.usage is None
    assert last.choices == [] and last.usage.completion_tokens == 6
    timeless = lambda chunk: {k: v for k, v in chunk.model_extra["speculative"].items() if k != "tokens_per_second"}
    assert timeless(last) == timeless(plain[-1])
    assert all(chunk.usage is None for chunk in chunks[:-1])
    assert plain[-1].usage.completion_tokens == 6  # without it, in the finish chunk as before


# A chat template that writes each role's messages after a word of its own (the tiny tokenizer has no template).
ROLES_CHAT = ("{% for m in messages %}{{ {'system': 'w7', 'user': 'w2', 'assistant': 'w4'}[m['role']] }} "
              "{{ m['content'] }} w1 {% endfor %}{% if add_generation_prompt %}w3 {% endif %}")


def test_developer_role_is_the_system_role(client, sampler, monkeypatch):
    monkeypatch.setattr(sampler.model.tokenizer, "chat_template", ROLES_CHAT)
    assert sampler.encode([{"role": "system", "content": "w5"}]) != sampler.encode([{"role": "user", "content": "w5"}])

    def answer(role: str) -> str:
        messages = [{"role": role, "content": "w7 w8"}, {"role": "user", "content": PROMPT}]
        return client.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                              temperature=0).choices[0].message.content

    assert answer("developer") == answer("system")


def test_retrieve_the_model(base_url, client, tiny_dir):
    assert client.models.retrieve(str(tiny_dir)).id == str(tiny_dir)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-4")


def test_a_cancelled_request_task_cancels_its_generation():
    """Ray Serve's proxy cancels the route's task when its client leaves (no disconnect message): the job is
    cancelled too, so the replica stops and the gateway's counts settle."""
    import asyncio

    from starlette.requests import Request

    from specsample.server.app import TextReply, respond
    from specsample.server.schemas import CompletionRequest

    class Waiting:
        cancelled = False

        async def next_event(self):
            await asyncio.Event().wait()

        def cancel(self) -> None:
            self.cancelled = True

    async def silent() -> dict:
        await asyncio.Event().wait()

    async def main() -> Waiting:
        job = Waiting()
        request = Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}, silent)
        task = asyncio.ensure_future(respond(request, CompletionRequest(prompt="w5"), job, TextReply("tiny")))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return job

    assert asyncio.run(main()).cancelled


def test_null_options_take_their_defaults(base_url):
    """The OpenAI API allows null for these; some clients send it for every option they leave unset."""
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": None, "top_p": None, "n": None, "stream": None,
            "seed": None, "stop": None}
    response = httpx.post(base_url + "/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1  # the text may be empty: sampled, the first token can end it


@pytest.mark.parametrize("body, message", [
    ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
    ({"max_completion_tokens": 0}, "max_completion_tokens must be >= 1, got 0"),
    ({"max_tokens": 2, "max_completion_tokens": 5}, "max_tokens (2) and max_completion_tokens (5) differ: give one of them"),
    ({"max_tokens": 1000}, "the prompt (3 tokens) and up to 1000 new tokens exceed the context window of 128 tokens"),
    ({"stream_options": {"include_usage": True}}, "stream_options is only allowed with stream: true"),
    ({"ignore_eos": True}, "ignore_eos is not supported by this server (got True)"),
    ({"prompt": [1, 2, 3]}, "prompt: a string or a list of one string is expected: prompts of token ids are not supported"),
    ({"prompt": [[1, 2, 3]]}, "prompt: a string or a list of one string is expected: prompts of token ids are not supported"),
    ({"tool_choice": "required"}, "tool_choice is not supported by this server (got 'required')"),
])
def test_a_bad_request_names_the_option_the_client_sent(base_url, body, message):
    response = httpx.post(base_url + "/v1/completions", json={"prompt": "w5 w6 w7", **body})
    assert response.status_code == 400 and response.json()["error"]["message"] == message, response.text


@pytest.mark.parametrize("body, param", [
    ({"temperature": -1}, "temperature"), ({"top_p": 2}, "top_p"), ({"top_k": -1}, "top_k"), ({"min_p": 2}, "min_p"),
    ({"max_tokens": 0}, "max_tokens"), ({"n": 3}, "n"), ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"logprobs": True}, "logprobs"), ({"max_tokens": "x"}, "max_tokens"), ({"seed": -1}, "seed"), ({"seed": 2**64}, "seed"),
    ({"prompt": ["w5", "w6"]}, "prompt"), ({"prompt": ""}, "prompt"),
])
def test_a_bad_requests_error_names_its_param(base_url, body, param):
    response = httpx.post(base_url + "/v1/completions", json={"prompt": "w5 w6 w7", **body})
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


@pytest.mark.parametrize("headers", [{}, {"Content-Type": "text/plain"}])
def test_a_body_sent_without_a_json_content_type_is_named_so(base_url, headers):
    response = httpx.post(base_url + "/v1/completions", content='{"prompt": "w5"}', headers=headers)
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert message.startswith("send the body as JSON with Content-Type: application/json (got "), message


def test_openai_options_left_off_are_accepted(client):
    """A client that sends the options of `schemas.UNSUPPORTED` at their "off" values, as some SDKs do, is served."""
    response = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=2, temperature=0, logprobs=None, echo=False, best_of=1,
        frequency_penalty=0, presence_penalty=0.0, logit_bias={}, user="someone",
    )
    assert response.choices[0].text
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "w5 w6"}], max_tokens=2, temperature=0, logprobs=False,
        response_format={"type": "text"}, tool_choice="none", modalities=["text"],
        extra_body={"ignore_eos": False, "min_tokens": 0, "stop_token_ids": [], "include_stop_str_in_output": False},
    )
    assert chat.choices[0].message.content


def wait_for(condition, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_disconnect_cancels_the_generation_and_frees_its_place(small_server):
    auth = {"Authorization": "Bearer secret"}
    long_request = {"prompt": PROMPT, "max_tokens": 2000, "temperature": 0}
    cancelled, generated = outcome_count(small_server, "cancelled"), generated_tokens(small_server)
    with httpx.Client(base_url=small_server, headers=auth, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json={**long_request, "stream": True}) as response:
            assert response.status_code == 200
            lines = response.iter_lines()  # held: dropping the iterator would close the connection
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["text"]
            busy = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
            assert busy.status_code == 503
            assert busy.json()["error"]["code"] == "queue_full"
        wait_for(lambda: outcome_count(small_server, "cancelled") == cancelled + 1)
        assert metrics(small_server)[("specsample_queue_depth", ())] == 0
        assert generated_tokens(small_server) == generated  # it never finished

        with pytest.raises(httpx.ReadTimeout):  # a client that gives up waiting on a whole response
            httpx.post(f"{small_server}/v1/completions", json=long_request, headers=auth, timeout=1.0)
        wait_for(lambda: outcome_count(small_server, "cancelled") == cancelled + 2)

        served = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0})
        assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 3


def test_api_key_is_checked(small_server):
    url = f"{small_server}/v1"
    for key in ("wrong", "secret2"):
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key=key, max_retries=0).models.list()
    assert httpx.get(f"{url}/models").status_code == 401
    for header in ("bearer secret", "BEARER  secret"):  # the scheme's name is case-insensitive (RFC 7235)
        assert httpx.get(f"{url}/models", headers={"Authorization": header}).status_code == 200
    for header in ("Bearer SECRET", "Basic secret", "secret"):
        assert httpx.get(f"{url}/models", headers={"Authorization": header}).status_code == 401
    good = openai.OpenAI(base_url=url, api_key="secret", max_retries=0)
    assert good.completions.create(model="x", prompt=PROMPT, max_tokens=2, temperature=0).usage.completion_tokens == 2
    assert httpx.get(f"{small_server}/health").status_code == 200


@pytest.mark.parametrize("args, message", [
    (["--k", "many"], "k must be"), (["--max-queue", "0"], "max_queue"),
    (["--drafter", "quantized+suffix"], "must be a lookup drafter"),  # refused before serving, not per request
    (["--port", "70000"], "port must be in 0..65535"), (["--host", "no-such-host.invalid"], "cannot listen on"),
    (["--api-key", ""], "the API key is empty"),  # an unset variable: no key at all would turn authentication off
    (["--api-key", "secret "], "printable ASCII without spaces"), (["--api-key", "sécret"], "printable ASCII"),
])
def test_serve_bad_arguments_give_one_line_and_exit_2(capsys, tiny_dir, args, message):
    with pytest.raises(SystemExit) as done:
        main(["serve", "--model", str(tiny_dir), *args])
    err = capsys.readouterr().err
    assert done.value.code == 2 and len(err.strip().splitlines()) == 1 and message in err


def test_serve_on_a_port_in_use_gives_one_line_and_exit_2(capsys, tiny_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(SystemExit) as done:
            main(["serve", "--model", str(tiny_dir), "--port", str(taken.getsockname()[1])])
    err = capsys.readouterr().err
    assert done.value.code == 2 and len(err.strip().splitlines()) == 1 and "cannot listen on 127.0.0.1:" in err


def test_serve_command_hands_uvicorn_an_app_on_loopback(monkeypatch, tiny_dir):
    runs = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **options: runs.append((app, options)))  # instead of blocking
    main(["serve", "--model", str(tiny_dir), "--backend", "transformers", "--port", "8765", "--api-key", "key"])
    (app, options), = runs
    assert options == {"host": "127.0.0.1", "port": 8765}
    with serving(app) as url:
        assert httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT}).status_code == 401
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="key", max_retries=0)
        response = client.completions.create(model="x", prompt=PROMPT, max_tokens=3, temperature=0)
        assert response.usage.completion_tokens == 3


@pytest.mark.slow
def test_bundled_model_chat_matches_generate(capsys):
    question = "Name three rivers in Europe."
    expected = cli_generate(capsys, question, "--temperature", "0", "--max-new-tokens", "16")
    sampler = SpecSampler.load()
    with serving(create_app(sampler)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        response = client.chat.completions.create(
            model=sampler.model.name, messages=[{"role": "user", "content": question}], max_tokens=16, temperature=0)
        text, last = stream_text(client.chat.completions.create(
            model=sampler.model.name, messages=[{"role": "user", "content": question}], max_tokens=16,
            temperature=0, stream=True))
    assert response.choices[0].message.content == text == expected["text"]
    assert last.usage.completion_tokens == len(expected["token_ids"])


def test_api_key_under_a_route_prefix(sampler):
    """Behind a route prefix (Ray Serve's route_prefix, an ASGI root_path), /v1 routes still need the key."""
    from fastapi.testclient import TestClient

    with TestClient(create_app(sampler, api_key="secret"), root_path="/prefix") as client:
        assert client.get("/prefix/v1/models").status_code == 401
        assert client.get("/prefix/v1/models", headers={"Authorization": "Bearer secret"}).status_code == 200
        assert client.get("/prefix/health").status_code == 200


def test_the_openapi_document_says_what_the_routes_answer(base_url):
    """Errors are 400, 401, 404 and 503 with the OpenAI error body (never FastAPI's 422), and /metrics is
    Prometheus text: what schemathesis checks the server against."""
    document = httpx.get(base_url + "/openapi.json").json()
    for route in ("/v1/completions", "/v1/chat/completions"):
        responses = document["paths"][route]["post"]["responses"]
        assert set(responses) == {"200", "400", "401", "503"}, responses
        assert responses["400"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
    assert set(document["paths"]["/v1/models/{model_id}"]["get"]["responses"]) == {"200", "401", "404"}
    assert "422" not in json.dumps(document) and "HTTPValidationError" not in json.dumps(document)
    assert list(document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    bad = httpx.post(base_url + "/v1/completions", json={"prompt": "w5", "top_p": 2})
    assert bad.status_code == 400 and set(bad.json()["error"]) == set(document["components"]["schemas"]["ErrorDetail"]["properties"])
