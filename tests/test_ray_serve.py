"""`specsample serve --replicas 2` end to end: a local Ray cluster with two replicas of the bundled model
(llamacpp, one thread each) behind one OpenAI-compatible endpoint on loopback, the official `openai`
client; then `--min-replicas 1 --max-replicas 2` on a second cluster, started after the first has
stopped. About 1.5 GB at a time, most of the time Ray's start-up."""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
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
COUNTING = "Here are the numbers from 1 to 10000: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"  # greedy: counts on and on


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


def start(args: list[str], log: Path, **env: str) -> tuple[subprocess.Popen, str]:
    """`specsample serve ARGS` on loopback with its own local Ray cluster, in a session of its own (Ray's
    daemons and workers stay in it: `session_processes`), Ctrl-C at its default as in a terminal; the
    process and its URL once it answers."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "PYTHONUNBUFFERED": "1",  # the replicas' log lines reach the log as they come,
           "RAY_DEDUP_LOGS": "0", **env}  # every one of them (tests read the replicas' calls there)
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "specsample.cli", "serve", *args, "--port", str(port), "--ray-address", "local"],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: healthy(url) or process.poll() is not None, 300, "the Ray application did not start")
        assert process.poll() is None, log.read_text()[-3000:]
    except BaseException:
        stop(process)
        raise
    return process, url


def session_processes(leader: int) -> list[psutil.Process]:
    """The processes of the session `leader` began, but the leader: a `start`ed server's Ray processes,
    and no other test's."""
    found = []
    for process in psutil.process_iter():
        with suppress(psutil.Error, ProcessLookupError):
            if process.pid != leader and os.getsid(process.pid) == leader:
                found.append(process)
    return found


def stop(process: subprocess.Popen) -> None:
    """SIGTERM, as Ctrl-C: the application and the local cluster stop; then whatever is left of the session."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(60)
    finally:  # if the shut-down failed, Ray's processes must not outlive the tests
        for leftover in session_processes(process.pid):
            with suppress(psutil.Error):
                leftover.kill()


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[tuple[str, psutil.Process, Path, subprocess.Popen]]:
    """`specsample serve --replicas 2 --prefix-affinity` in a subprocess (every test here passes through Ray
    Serve's prefix-aware router); its URL, process, log and Popen."""
    log = tmp_path_factory.mktemp("ray") / "serve.log"
    process, url = start(["--replicas", "2", "--prefix-affinity", *FLAGS, "--api-key", KEY], log)
    server = psutil.Process(process.pid)
    try:
        wait_for(lambda: len(engine_replicas(server)) == 2, 60, "two Engine replicas")
        yield url, server, log, process
    finally:
        stop(process)


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


def replica_of(log: Path, request_id: str) -> str | None:
    """The Engine replica that ran a request, from Ray Serve's log line of the call ("specsample_Engine
    REPLICA REQUEST_ID -- CALL generate OK"); the request id is the client's X-Request-Id."""
    found = re.search(rf"specsample_Engine (\S+) {re.escape(request_id)} -- CALL generate", log.read_text())
    return found and found.group(1)


def test_prefix_affinity_keeps_a_prefix_on_one_replica(server):
    """Requests one at a time (both replicas idle): for each of four long prompt prefixes, three prompts that
    share it run on the same replica (by chance, with power of two choices: 1 in 256)."""
    url, log = server[0], server[2]
    for n, topic in enumerate(("rain", "the sea", "mountains", "old cities")):
        prefix = f"Here is a long description of {topic}, with every detail that matters. " * 12
        replicas = set()
        for i in range(3):
            request_id = f"affinity-{n}-{i}-{time.monotonic_ns()}"
            reply = httpx.post(f"{url}/v1/completions", timeout=60,
                               json={"prompt": f"{prefix}Question {i}: why?", "max_tokens": 2, "temperature": 0},
                               headers={"Authorization": f"Bearer {KEY}", "X-Request-Id": request_id})
            assert reply.status_code == 200, reply.text
            wait_for(lambda: replica_of(log, request_id) is not None, 30, "no log line of the replica's call")
            replicas.add(replica_of(log, request_id))
        assert len(replicas) == 1, (topic, replicas)


def test_errors_and_api_key(server, client):
    url = server[0]
    bad = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "temperature": -1},
                     headers={"Authorization": f"Bearer {KEY}"})
    assert bad.status_code == 400 and "temperature" in bad.json()["error"]["message"]
    empty = httpx.post(f"{url}/v1/completions", json={"prompt": ""}, headers={"Authorization": f"Bearer {KEY}"})
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
    body = {"prompt": COUNTING, "max_tokens": 6000, "temperature": 0, "stream": True}  # counts to the end: a minute
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60) as response:
        assert response.status_code == 200
        next(response.iter_lines())  # the stream has begun; then the client goes away
    wait_for(lambda: counted(url, "specsample_requests", outcome="cancelled") == cancelled + 1, 30,
             "the gateway did not cancel the request")
    wait_for(lambda: gauge(url, "specsample_queue_depth") == 0, 30, "the request still holds its place")
    # a generation left running keeps a core busy; idle replicas use about 0.01 CPU seconds a second (Ray
    # Serve's health checks). Not Ray Serve's log line of the call ("CALL generate CANCELLED"): it is missing
    # for about 1 cancelled call in 15 whose replica has stopped (4 of 60 leaves, two processes spinning beside the tests)
    wait_for(lambda: replicas_busy(server[1], 2.0) < 0.5, 20, "the replica's generation was not cancelled")
    assert stream_text(client, PROMPTS[2])[0]


def replicas_busy(server: psutil.Process, seconds: float) -> float:
    """The Engine replicas' CPU seconds over the next `seconds`."""
    replicas = engine_replicas(server)
    before = cpu_seconds(replicas)
    time.sleep(seconds)
    return sum(cpu_seconds(replicas)) - sum(before)


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


def assert_stops(process: subprocess.Popen, signum: int, returncode: int) -> None:
    """After `signum` the server exits with `returncode` within a minute and none of its session's
    processes (raylet, gcs_server, Ray's agents and workers) is alive 30 s later."""
    names = {p.name() for p in alive(session_processes(process.pid))}
    assert {"raylet", "gcs_server"} <= names, names
    start = time.monotonic()
    if signum == signal.SIGINT:
        os.killpg(process.pid, signum)  # as a terminal's Ctrl-C
    else:
        process.send_signal(signum)
    assert process.wait(60) == returncode
    print(f"stopped by {signal.Signals(signum).name} in {time.monotonic() - start:.1f} s")
    wait_for(lambda: not alive(session_processes(process.pid)), 30,
             f"Ray's processes outlived the server: {alive(session_processes(process.pid))}")


def alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    found = []
    for process in processes:
        with suppress(psutil.Error):
            if process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
    return found


def test_sigterm_stops_serve_and_the_cluster(server):
    """The last test on `server`: SIGTERM (a service manager's stop) deletes the application, shuts Serve and
    the local cluster down, then ends the process by SIGTERM as uvicorn's `specsample serve` does."""
    assert_stops(server[3], signal.SIGTERM, -signal.SIGTERM)


SCALING = ("--min-replicas", "1", "--max-replicas", "2", "--target-queue", "1", "--upscale-delay", "0",
           "--downscale-delay", "2", "--look-back", "2", "--max-queue", "8")
# replicas and handles report their queues to Ray Serve's controller every 10 s by default: every 0.5 s here
PUSH = {"RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
        "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5"}
STATUS = """
import json, sys, time
import ray
from ray import serve
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
while True:
    engine = serve.status().applications["specsample"].deployments["Engine"]
    print(json.dumps({"states": engine.replica_states, "trigger": engine.status_trigger}), flush=True)
    time.sleep(0.5)
"""


class ServeStatus:
    """Ray Serve's own view of the Engine deployment (`serve.status()`), read twice a second by a second Ray
    driver (a subprocess, so that Ray stays out of pytest's process) connected to the server's cluster."""

    def __init__(self, server: int) -> None:
        raylet = next(p for p in session_processes(server) if p.name() == "raylet")
        gcs = next(a.split("=", 1)[1] for a in raylet.cmdline() if a.startswith("--gcs-address="))
        self.process = subprocess.Popen([sys.executable, "-c", STATUS, gcs], stdout=subprocess.PIPE, text=True,
                                        env={**os.environ, "RAY_AUTH_MODE": "token"})  # the cluster's ~/.ray/auth_token
        self.latest: dict = {}
        threading.Thread(target=self.read, daemon=True).start()

    def read(self) -> None:
        for line in self.process.stdout:
            self.latest = json.loads(line)

    def scaled_to(self, n: int, trigger: str) -> bool:
        """Exactly `n` replicas, all running, after an autoscaling decision (`status_trigger` `trigger`)."""
        return self.latest.get("states") == {"RUNNING": n} and self.latest.get("trigger") == trigger

    def close(self) -> None:
        self.process.kill()
        self.process.wait()


@pytest.fixture(scope="module")
def scaled(tmp_path_factory) -> Iterator[tuple[str, subprocess.Popen, ServeStatus]]:
    """`specsample serve --min-replicas 1 --max-replicas 2` in a subprocess, quick to scale; its URL, Popen
    and Ray Serve's status."""
    process, url = start([*SCALING, *FLAGS], tmp_path_factory.mktemp("scaled") / "serve.log", **PUSH)
    try:
        status = ServeStatus(process.pid)
        try:
            yield url, process, status
        finally:
            status.close()
    finally:
        if process.poll() is None:
            stop(process)


async def endless_stories(url: str) -> None:
    """One client of the load: streamed requests one after another, until cancelled (which closes them)."""
    body = {"messages": [{"role": "user", "content": "Tell a very long story."}], "max_tokens": 4000,
            "stream": True}
    async with httpx.AsyncClient(timeout=120) as client:
        while True:
            async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
                assert response.status_code == 200, await response.aread()
                async for _ in response.aiter_lines():
                    pass


async def under_load(url: str, clients: int, condition, seconds: float, what: str) -> None:
    """`clients` endless clients until `condition()` holds (at most `seconds`); then they leave."""
    load = [asyncio.create_task(endless_stories(url)) for _ in range(clients)]
    try:
        deadline = time.monotonic() + seconds
        while not condition():
            assert time.monotonic() < deadline, what
            for task in load:
                if task.done():
                    task.result()  # a client's failure, raised here
            await asyncio.sleep(0.5)
    finally:
        for task in load:
            task.cancel()
        await asyncio.gather(*load, return_exceptions=True)


def test_autoscaling_adds_a_replica_under_load_and_removes_it_after(scaled):
    """Four clients keep four requests in the one replica's queue against a target of one (the options in
    SCALING and PUSH): Ray Serve adds the second replica; when they leave, it removes it again."""
    url, _, status = scaled
    wait_for(lambda: status.latest.get("states") == {"RUNNING": 1}, 60, f"one replica at rest: {status.latest}")
    start = time.monotonic()
    asyncio.run(under_load(url, 4, lambda: status.scaled_to(2, "UPSCALE_COMPLETED"), 120,
                           f"Ray Serve did not add a replica: {status.latest}"))
    print(f"second replica running after {time.monotonic() - start:.1f} s of load")
    start = time.monotonic()
    wait_for(lambda: status.scaled_to(1, "DOWNSCALE_COMPLETED"), 60,
             f"Ray Serve did not remove the replica: {status.latest}")
    print(f"back to one replica {time.monotonic() - start:.1f} s after the load")
    assert healthy(url)


def test_the_gateway_admits_every_place_it_promises_and_refuses_the_next(scaled):
    """`--max-queue 8` and at most 2 replicas: 8 requests a replica and 8 more waiting, 24 at once, arriving
    together, are all admitted (Ray Serve's own queue bound refused some of them early); the 25th gets 503."""
    url = scaled[0]
    rejected = counted(url, "specsample_requests", outcome="rejected")
    body = {"prompt": COUNTING, "max_tokens": 4000, "temperature": 0}

    async def load() -> httpx.Response:
        async with httpx.AsyncClient(timeout=120) as client:
            held = [asyncio.create_task(client.post(f"{url}/v1/completions", json=body)) for _ in range(24)]
            try:
                deadline = time.monotonic() + 60
                while gauge(url, "specsample_queue_depth") < 24:
                    assert time.monotonic() < deadline and not any(task.done() for task in held), [
                        task.result().text for task in held if task.done()]
                    await asyncio.sleep(0.2)
                extra = await client.post(f"{url}/v1/completions", json=body)
                assert not [task.result().text for task in held if task.done()]  # none refused by a replica
                return extra
            finally:
                for task in held:
                    task.cancel()
                await asyncio.gather(*held, return_exceptions=True)

    extra = asyncio.run(load())
    assert extra.status_code == 503 and extra.json()["error"]["code"] == "queue_full", extra.text
    assert counted(url, "specsample_requests", outcome="rejected") == rejected + 1
    wait_for(lambda: gauge(url, "specsample_queue_depth") == 0, 60, "the cancelled requests still hold places")
    assert healthy(url)


def test_ctrl_c_stops_serve_and_the_cluster(scaled):
    """The last test on `scaled`: Ctrl-C in a terminal (SIGINT to the foreground process group: the server
    and Ray's daemons, not Ray's workers, which have groups of their own) leaves none of the cluster's
    processes, and the server exits with 130 (KeyboardInterrupt, re-raised after the shut-down)."""
    scaled[2].close()
    assert_stops(scaled[1], signal.SIGINT, 130)


def test_replicas_without_ray_is_one_line(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if the extra were not installed
    with pytest.raises(SystemExit) as done:
        main(["serve", "--replicas", "2"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.count("\n") == 1 and "specsample[ray]" in err


@pytest.mark.parametrize("args, message", [
    (["--replicas", "0"], "--replicas: Input should be greater than or equal to 1"),
    (["--min-replicas", "3", "--max-replicas", "2"], "min_replicas (3) must be <= max_replicas (2)"),
    (["--replicas", "2", "--max-replicas", "3"], "replicas (a fixed count) and max_replicas (autoscaling) were both given"),
    (["--replicas", "2", "--target-queue", "3"], "replicas (a fixed count) and target_queue (autoscaling) were both given"),
    (["--replicas", "2", "--k", "bogus"], "k must be an integer"),
    (["--replicas", "2", "--threads", "0"], "--threads:"),
])
def test_bad_replica_options_are_one_line(capsys, args, message):
    """Checked before Ray starts: one line, exit code 2."""
    with pytest.raises(SystemExit) as done:
        main(["serve", *args])
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.count("\n") == 1 and message in err, err


def test_replicas_on_llamacpp_without_llama_cpp_is_one_line(capsys, monkeypatch):
    """Checked before Ray starts, as the other options are (each replica had failed to build, and the
    driver ended in a traceback after Ray's start)."""
    from specsample.models import choice

    monkeypatch.setattr(choice, "llamacpp_installed", lambda: False)  # as if the extra were not installed
    with pytest.raises(SystemExit) as done:
        main(["serve", "--replicas", "1", "--backend", "llamacpp"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.count("\n") == 1 and "needs llama-cpp-python" in err, err
