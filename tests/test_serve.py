"""mtp-serve as a real process, spoken to with OpenAI's own client: its greedy answers are the
Python API's, streams add up to the same text and end with [DONE], a client that leaves stops its
generation, bad requests get OpenAI's error body, and a burst past the queue gets 503s."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time

import httpx
import openai
import pytest
from tiny import hf_reference, save_hf_dir

import mtp_edge

# A ChatML-like template in the tiny tokenizer's alphabet (lower case, no newline).
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "tell me a story"}]
PROMPT = "the cat sat on the"
LONG = 400  # tokens: about a second and a half of generation for the tiny model here


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = save_hf_dir(hf_reference("llama", seed=3), tmp_path_factory.mktemp("serve-model"))
    config = {"chat_template": TEMPLATE, "eos_token": "<|im_end|>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def reference(model_dir):
    """The same model through the Python API, in this process."""
    return mtp_edge.load(str(model_dir))


@pytest.fixture(scope="module")
def raw_reference(model_dir):
    """The same model reading prompts as plain text, as /v1/completions does."""
    return mtp_edge.load(str(model_dir), chat=False)


class Served:
    def __init__(self, process: subprocess.Popen, url: str, log):
        self.process, self.url, self.log = process, url, log
        self.base = url.removesuffix("/v1")
        self.client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)

    def health(self) -> dict:
        response = httpx.get(f"{self.base}/health", timeout=10)
        assert response.status_code == 200
        return response.json()


def started(log, process, timeout: float = 120.0) -> str:
    """The URL mtp-serve says it serves, once it says so."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(r"at (http://\S+/v1)", log.read_text())
        if found:
            return found.group(1)
        assert process.poll() is None, f"mtp-serve ended: {log.read_text()}"
        time.sleep(0.1)
    raise AssertionError(f"mtp-serve did not start: {log.read_text()}")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-log") / "stderr.txt"
    command = [shutil.which("mtp-serve"), "--model", str(model_dir), "--port", "0"]
    with open(log, "w") as stderr:
        process = subprocess.Popen(
            [*command, "--max-queue", "2"], stdout=subprocess.DEVNULL, stderr=stderr
        )
    try:
        yield Served(process, started(log, process), log)
    finally:
        process.send_signal(signal.SIGTERM)
        code = process.wait(60)
    # SIGTERM, the ordinary way to stop a server: a clean stop, then 128 + 15 as the README says
    assert code == 143 and "stopped by SIGTERM" in log.read_text(), (code, log.read_text())
    assert "Traceback" not in log.read_text()


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGHUP, 129)])
def test_ctrl_c_and_sighup_stop_cleanly_with_their_codes(model_dir, tmp_path, signum, code):
    """Ctrl-C (SIGINT, as a terminal sends it to the process group) and SIGHUP stop mtp-serve
    as SIGTERM does: a request running at the time is ended, then exit 128 + the signal."""
    log = tmp_path / "stderr.txt"
    command = [shutil.which("mtp-serve"), "--model", str(model_dir), "--port", "0"]
    with open(log, "w") as stderr:
        process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True
        )
    try:
        url = started(log, process)
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
        assert client.models.list().data
        os.killpg(process.pid, signum)  # the whole group, as the terminal does
        assert process.wait(60) == code, log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    name = signal.Signals(signum).name
    assert f"stopped by {name}" in log.read_text() and "Traceback" not in log.read_text()


def test_lists_its_one_model_and_answers_health(server, reference):
    models = server.client.models.list()
    assert [m.id for m in models.data] == [reference.name]
    assert server.health()["status"] == "ok"


def test_chat_is_the_apis_chat(server, reference):
    expected = reference.chat(CHAT, max_new_tokens=24)
    answer = server.client.chat.completions.create(
        model="anything", messages=CHAT, max_tokens=24, temperature=0
    )
    assert answer.choices[0].message.content == expected.text
    assert answer.choices[0].message.role == "assistant"
    assert (
        answer.choices[0].finish_reason
        == {"eos": "stop", "max_tokens": "length"}[expected.finish_reason]
    )
    assert answer.usage.prompt_tokens == expected.prompt_tokens
    assert answer.usage.completion_tokens == len(expected.token_ids)
    assert answer.usage.total_tokens == expected.prompt_tokens + len(expected.token_ids)
    stats = answer.model_extra["mtp_edge"]
    assert stats["generated_tokens"] == len(expected.token_ids) and stats["tau"] >= 1

    stream = server.client.chat.completions.create(
        model="anything", messages=CHAT, max_tokens=24, temperature=0, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert [c.choices[0].finish_reason for c in chunks][-1] == answer.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_completion_is_the_apis_generate(server, raw_reference):
    expected = raw_reference.generate(PROMPT, max_new_tokens=30)
    answer = server.client.completions.create(model="m", prompt=PROMPT, max_tokens=30)
    assert answer.choices[0].text == expected.text
    assert answer.usage.completion_tokens == len(expected.token_ids)
    stream = server.client.completions.create(
        model="m", prompt=PROMPT, max_tokens=30, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)

    # stop texts end the answer before them, as the API does
    stop = expected.text[len(expected.text) // 2 :][:3]
    stopped = raw_reference.generate(PROMPT, max_new_tokens=30, stop=(stop,))
    answer = server.client.completions.create(model="m", prompt=PROMPT, max_tokens=30, stop=stop)
    assert answer.choices[0].text == stopped.text and answer.choices[0].finish_reason == "stop"


def test_a_conversation_reuses_its_cached_start(server, reference):
    first = server.client.chat.completions.create(model="m", messages=CHAT, max_tokens=8)
    reply = {"role": "assistant", "content": first.choices[0].message.content}
    longer = [*CHAT, reply, {"role": "user", "content": "and then"}]
    expected = reference.chat(longer, max_new_tokens=8)
    answer = server.client.chat.completions.create(model="m", messages=longer, max_tokens=8)
    assert answer.choices[0].message.content == expected.text
    cached = answer.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens <= cached < answer.usage.prompt_tokens


def test_stream_ends_with_done(server):
    body = {"prompt": PROMPT, "max_tokens": 8, "stream": True}
    with httpx.stream("POST", f"{server.url}/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-1])


def test_health_answers_during_a_generation_and_a_client_that_leaves_stops_it(server, reference):
    whole = reference.chat(CHAT, max_new_tokens=LONG)
    assert whole.finish_reason == "max_tokens"  # left alone, it would generate LONG tokens
    before = server.health()
    stream = server.client.chat.completions.create(
        model="m", messages=CHAT, max_tokens=LONG, stream=True
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    during = server.health()  # the event loop is free while the model works
    assert during["generating"]
    stream.close()
    deadline = time.monotonic() + 30
    while server.health()["generating"] and time.monotonic() < deadline:
        time.sleep(0.05)
    after = server.health()
    assert after["cancelled"] == before["cancelled"] + 1
    assert after["generated_tokens"] - before["generated_tokens"] < LONG  # stopped early
    # and the next request is served as usual
    expected = reference.chat(CHAT, max_new_tokens=12)
    answer = server.client.chat.completions.create(model="m", messages=CHAT, max_tokens=12)
    assert answer.choices[0].message.content == expected.text


def error_of(response: httpx.Response) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and "Traceback" not in response.text
    return error


@pytest.mark.parametrize(
    "body, fragment",
    [
        ('{"messages": [{"role": "user", "content": "hi"}', "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"messages": []}', "messages"),
        ('{"max_tokens": 5}', "messages"),
        ('{"messages": [{"role": "user", "content": 3}]}', "messages.0.content"),
        ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}', "max_tokens"),
        ('{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}', "temperature"),
        ('{"messages": [{"role": "user", "content": "hi"}], "stop": [""]}', "stop"),
        ('{"messages": [{"role": "user", "content": "hi"}], "stop": 5}', "stop"),
        ('{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "x"}]}', "tools"),
    ],
)
def test_bad_requests_get_openai_errors(server, body, fragment):
    response = httpx.post(f"{server.url}/chat/completions", content=body, timeout=60)
    assert fragment in error_of(response)["message"]


HI = '"messages": [{"role": "user", "content": "hi"}]'


@pytest.mark.parametrize(
    "field, value, fragment",
    [
        ("temperature", "1e400", "temperature must be a finite number >= 0 (0 = greedy), got inf"),
        ("temperature", "NaN", "temperature must be a finite number >= 0 (0 = greedy), got nan"),
        ("temperature", "-0.5", "temperature must be a finite number >= 0"),
        ("temperature", '"hot"', "temperature: Input should be a valid number"),
        ("top_p", "0", "top_p must be a finite number in (0, 1]"),
        ("top_p", "Infinity", "top_p must be a finite number in (0, 1]"),
        ("top_k", "-1", "top_k must be an integer >= 0"),
        ("seed", "-1", "seed must be an integer in 0..18446744073709551615"),
        ("seed", "18446744073709551616", "seed must be an integer in 0..18446744073709551615"),
        ("max_tokens", "0", "max_tokens must be an integer >= 1"),
        ("max_completion_tokens", "0", "max_completion_tokens must be an integer >= 1"),
        ("stop", '[""]', "stop: a stop string must be non-empty"),
        ("stop", "[1]", "stop must be a text or a list of texts"),
    ],
)
def test_bad_fields_are_named_in_openais_error_shape(server, field, value, fragment):
    """Each field is checked with the commands' ranges and named as the request names it (no
    command-line flag), in `param` too."""
    body = f'{{{HI}, "{field}": {value}}}'
    for path in ("chat/completions", "completions"):
        if path == "completions":
            body = f'{{"prompt": "the cat", "{field}": {value}}}'
        error = error_of(httpx.post(f"{server.url}/{path}", content=body, timeout=60))
        assert error["param"] == field and fragment in error["message"], error
        assert "--" not in error["message"]


def test_unsupported_and_too_long_requests_are_refused(server):
    with pytest.raises(openai.BadRequestError, match="not supported"):
        server.client.chat.completions.create(model="m", messages=CHAT, n=2)
    too_long = {"prompt": "the cat " * 400, "max_tokens": 4}
    response = httpx.post(f"{server.url}/completions", json=too_long, timeout=60)
    assert "context" in error_of(response)["message"]


def test_a_burst_past_the_queue_gets_503(server, raw_reference):
    """Six clients at once, one generating and two waiting (--max-queue 2): the others are
    refused at once, and the served ones get the right answer."""
    expected = raw_reference.generate(PROMPT, max_new_tokens=LONG)
    assert expected.finish_reason == "max_tokens"  # every request is long
    start = threading.Barrier(6)
    results = []

    def ask():
        start.wait()
        try:
            answer = server.client.completions.create(model="m", prompt=PROMPT, max_tokens=LONG)
            results.append((200, answer.choices[0].text))
        except openai.APIStatusError as e:
            results.append((e.status_code, e.response.headers.get("retry-after")))

    threads = [threading.Thread(target=ask) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(results) == 6
    assert all(r in ((200, expected.text), (503, "1")) for r in results), results
    assert {status for status, _ in results} == {200, 503}


def test_a_taken_port_is_one_line_error(server):
    port = server.url.rsplit(":", 1)[1].removesuffix("/v1")
    result = subprocess.run(
        [shutil.which("mtp-serve"), "--port", port], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert "in use" in result.stderr and result.stderr.startswith("error: ")


def test_a_port_is_held_from_the_start_of_loading():
    """Two servers started together: the second is refused at once, not after loading its model
    and failing in uvicorn (a bound socket that does not listen yet holds no port on Linux)."""
    from mtp_edge.cli.serve import _listen
    from mtp_edge.errors import UserError

    first = _listen("127.0.0.1", 0)
    try:
        port = first.getsockname()[1]
        with pytest.raises(UserError, match=f"port {port} on 127.0.0.1 is in use"):
            _listen("127.0.0.1", port).close()
    finally:
        first.close()


def test_a_taken_port_leaves_no_log_folder(tmp_path):
    from click.testing import CliRunner

    from mtp_edge.cli.serve import _listen, serve

    held = _listen("127.0.0.1", 0)
    try:
        port = str(held.getsockname()[1])
        log = tmp_path / "new" / "log"
        result = CliRunner().invoke(serve, ["--port", port, "--log", str(log)])
        assert result.exit_code == 2 and "is in use" in result.output, result.output
        assert not (tmp_path / "new").exists()
    finally:
        held.close()
