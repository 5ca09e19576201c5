"""`specsample serve --replicas 2` end to end: a local Ray cluster with two replicas of the bundled model
(llamacpp, one thread each) behind one OpenAI-compatible endpoint on loopback, the official `openai`
client. One cluster for the module: about a minute and 1.5 GB in all, most of it Ray's start-up."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import redirect_stdout, suppress
from importlib.util import find_spec
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specsample.cli import main

pytestmark = [
    pytest.mark.skipif(find_spec("ray") is None, reason="Ray Serve is the optional extra specsample[ray]"),
    pytest.mark.xdist_group("ray"),  # one worker, one cluster (scripts/test.sh: --dist loadgroup)
]

SRC = Path(__file__).resolve().parents[1] / "src"
ENGINE = "ray::ServeReplica:specsample:Engine"
KEY = "secret"
FLAGS = ("--backend", "llamacpp", "--threads", "1", "--drafter", "suffix", "--k", "3")
PROMPTS = ["Name three colours.", "What is 2 + 2?", "Write a haiku about rain.", "Say hello in French."]
MAX_TOKENS = 24


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_replicas(server: psutil.Process) -> list[psutil.Process]:
    """The Engine replicas' processes, among the descendants of the `specsample serve` process."""
    found = []
    for process in server.children(recursive=True):
        try:
            if process.cmdline()[:1] == [ENGINE]:
                found.append(process)
        except psutil.NoSuchProcess:
            pass
    return found


def wait_for(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.5)


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[tuple[str, psutil.Process, Path]]:
    """`specsample serve --replicas 2` in a subprocess (its own local Ray cluster); its URL, process and log."""
    port, log = free_port(), tmp_path_factory.mktemp("ray") / "serve.log"
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "PYTHONUNBUFFERED": "1"}  # the replicas' log lines reach the log as they come
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "specsample.cli", "serve", "--replicas", "2", *FLAGS, "--api-key", KEY,
             "--port", str(port), "--ray-address", "local"],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url, server = f"http://127.0.0.1:{port}", psutil.Process(process.pid)
    try:
        wait_for(lambda: healthy(url) or process.poll() is not None, 300, "the Ray application did not start")
        assert process.poll() is None, log.read_text()[-3000:]
        wait_for(lambda: len(engine_replicas(server)) == 2, 60, "two Engine replicas")
        yield url, server, log
    finally:
        process.send_signal(signal.SIGTERM)  # as Ctrl-C: the application and the local cluster stop
        try:
            process.wait(60)
        finally:  # Ray's agents outlive their raylet for a while: end them with the rest of the session
            with suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def references() -> dict[str, str]:
    """`specsample generate`'s greedy text of each prompt, with the replicas' flags."""
    texts = {}
    for prompt in PROMPTS:
        out = io.StringIO()
        with redirect_stdout(out):
            main(["generate", prompt, *FLAGS, "--temperature", "0", "--max-new-tokens", str(MAX_TOKENS), "--json"])
        texts[prompt] = json.loads(out.getvalue())["text"]
    assert len(set(texts.values())) == len(PROMPTS)  # distinct answers: a mixed-up response would show
    return texts


def stream_text(client: openai.OpenAI, prompt: str) -> tuple[str, openai.types.chat.ChatCompletionChunk]:
    """A streamed greedy chat completion: its text and its last chunk (usage and `speculative`)."""
    stream = client.chat.completions.create(model="any", messages=[{"role": "user", "content": prompt}],
                                            max_tokens=MAX_TOKENS, temperature=0, stream=True)
    parts, ids, last = [], set(), None
    for chunk in stream:
        ids.add(chunk.id)
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        last = chunk
    assert len(ids) == 1  # one response, not pieces of several
    return "".join(parts), last


def cpu_seconds(processes: list[psutil.Process]) -> list[float]:
    return [sum(p.cpu_times()[:2]) for p in processes]


def counted(url: str, family: str, **labels: str) -> float:
    """A counter of the gateway's /metrics (all replicas' requests), summed over the samples with `labels`."""
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}
    samples = families[family].samples if family in families else []
    return sum(s.value for s in samples if s.name.endswith("_total") and labels.items() <= s.labels.items())


def test_sixteen_streams_over_both_replicas_match_generate(server, client, references):
    replicas, generated = engine_replicas(server[1]), counted(server[0], "specsample_generated_tokens")
    before = cpu_seconds(replicas)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda p: stream_text(client, p), prompts))
    busy = [after - start for after, start in zip(cpu_seconds(replicas), before)]
    for prompt, (text, last) in zip(prompts, results):
        assert text == references[prompt]
        assert last.model_extra["speculative"]["drafter"] == "suffix" and last.model_extra["speculative"]["steps"] >= 1
    assert min(busy) > 0.2, f"CPU seconds per replica {busy}: the requests did not go to both"
    generated = counted(server[0], "specsample_generated_tokens") - generated
    assert generated == sum(last.usage.completion_tokens for _, last in results)


def test_errors_and_api_key(server, client):
    url = server[0]
    bad = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "temperature": -1},
                     headers={"Authorization": f"Bearer {KEY}"})
    assert bad.status_code == 400 and "temperature" in bad.json()["error"]["message"]
    empty = httpx.post(f"{url}/v1/completions", json={"prompt": " "}, headers={"Authorization": f"Bearer {KEY}"})
    assert empty.status_code == 400 and empty.json()["error"]["type"] == "invalid_request_error"
    for stream in (False, True):  # refused by the replica's engine: a 400 through the gateway, before any event
        long = httpx.post(f"{url}/v1/completions", json={"prompt": "word " * 10_000, "stream": stream},
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        assert long.status_code == 400 and "context" in long.json()["error"]["message"], long.text
    assert httpx.get(f"{url}/v1/models").status_code == 401
    reply = client.completions.create(model="any", prompt="The capital of France is", max_tokens=8, temperature=0)
    assert reply.usage.completion_tokens >= 1 and reply.model_extra["speculative"]["drafter"] == "suffix"


def gauge(url: str, name: str) -> float:
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}
    return families[name].samples[0].value


def test_a_client_that_leaves_frees_its_place(server, client):
    """The gateway cancels the replica's call, and Ray Serve the replica's generator (whose EngineWorker job
    stops between two engine steps, as test_server.py shows for one process)."""
    url, cancelled = server[0], counted(server[0], "specsample_requests", outcome="cancelled")
    calls = cancelled_calls(server[2])
    body = {"messages": [{"role": "user", "content": "Tell a very long story."}], "max_tokens": 4000, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60) as response:
        assert response.status_code == 200
        next(response.iter_lines())  # the stream has begun; then the client goes away
    wait_for(lambda: counted(url, "specsample_requests", outcome="cancelled") == cancelled + 1, 30,
             "the gateway did not cancel the request")
    wait_for(lambda: gauge(url, "specsample_queue_depth") == 0, 30, "the request still holds its place")
    # Ray Serve logs each replica call's end: "CALL generate CANCELLED <ms>" (at once) or "OK" (4000 tokens later)
    wait_for(lambda: cancelled_calls(server[2]) > calls, 90, "the replica's generation was not cancelled")
    assert stream_text(client, PROMPTS[2])[0]


def cancelled_calls(log: Path) -> int:
    return sum(ENGINE[5:] in line and "CALL generate CANCELLED" in line for line in log.read_text().splitlines())


def ask(client: openai.OpenAI, i: int) -> str:
    """One request of the load: streamed or not; 'ok', or the kind of error body it got."""
    messages = [{"role": "user", "content": f"Count from {i} to {i + 40}."}]
    try:
        if i % 2:
            for _ in client.chat.completions.create(model="any", messages=messages, max_tokens=48, stream=True):
                pass
        else:
            client.chat.completions.create(model="any", messages=messages, max_tokens=48)
        return "ok"
    except openai.APIStatusError as error:
        assert error.status_code == 503 and error.body["code"] == "replica_failed", error.body
        return "503"
    except openai.APIError as error:  # an error event in a stream that had begun
        assert "replica" in error.message, error.message
        return "stream error"


def answers(client: openai.OpenAI) -> bool:
    try:
        return bool(stream_text(client, PROMPTS[0])[0])
    except openai.APIError:
        return False


def test_replica_killed_under_load(server, client):
    serving, errors = server[1], counted(server[0], "specsample_requests", outcome="error")
    victim = engine_replicas(serving)[0]
    start = time.monotonic()
    with ThreadPoolExecutor(20) as pool:
        outcomes = [pool.submit(ask, client, i) for i in range(20)]
        time.sleep(2)
        victim.kill()
        results = [outcome.result(timeout=180) for outcome in outcomes]
    print("outcomes under a replica's death:", results, f"{time.monotonic() - start:.1f} s")
    assert time.monotonic() - start < 180
    assert "ok" in results and set(results) - {"ok"}, results  # the others served; the victim's failed clearly
    assert counted(server[0], "specsample_requests", outcome="error") - errors == 20 - results.count("ok")
    wait_for(lambda: answers(client), 60, "the service did not answer again")
    wait_for(lambda: len([p for p in engine_replicas(serving) if p.pid != victim.pid]) == 2, 180,
             "Ray did not restart the replica")
    assert stream_text(client, PROMPTS[1])[0]


def test_replicas_without_ray_is_one_line(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if the extra were not installed
    with pytest.raises(SystemExit) as done:
        main(["serve", "--replicas", "2"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.count("\n") == 1 and "specsample[ray]" in err


@pytest.mark.parametrize("args, message", [
    (["--replicas", "0"], "--replicas: Input should be greater than or equal to 1"),
    (["--min-replicas", "3", "--max-replicas", "2"], "min_replicas (3) must be <= max_replicas (2)"),
    (["--replicas", "2", "--max-replicas", "3"], "not both"),
    (["--replicas", "2", "--k", "bogus"], "k must be an integer"),
    (["--replicas", "2", "--threads", "0"], "--threads:"),
])
def test_bad_replica_options_are_one_line(capsys, args, message):
    """Checked before Ray starts: one line, exit code 2."""
    with pytest.raises(SystemExit) as done:
        main(["serve", *args])
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.count("\n") == 1 and message in err, err
