"""Chat and the OpenAI-compatible HTTP API, through a real supervisor, with real clients.

The official ``openai`` package talks to the HTTP API; the gRPC client sends
messages; the terminal chat runs as its own process. SmolLM2 is the chat model;
the default pair has no chat template (and speculates).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import grpc
import httpx
import openai
import pytest

from common.protocol import runner_pb2
from supervisor.protocol import supervisor_pb2
from tests.helpers import CHAT_TOKEN, on_a_terminal
from tests.processes import child_environment, wait_until

TOKEN = CHAT_TOKEN
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The for statement is used to iterate over the elements of a sequence"


@pytest.fixture(scope="module")
def sup(chat_supervisor):
    return chat_supervisor


@pytest.fixture(scope="module")
def client(chat_client):
    return chat_client


# -- chat over gRPC --------------------------------------------------------------------------------------


def grpc_chat(sup, model: str, messages, **fields):
    request = supervisor_pb2.GenerateRequest(model=model, **fields)
    for message in messages:
        request.messages.add(**message)
    return list(sup.client.stub.Generate(request, timeout=120, metadata=sup.client.metadata))


def test_grpc_chat_uses_the_chat_template_and_stops_at_the_end_of_the_turn(sup):
    # A system message no earlier test sent (the supervisor is shared): nothing of it is in the prompt cache.
    conversation = [{"role": "system", "content": f"Session {time.time_ns()}. You are a helpful assistant."}, *CAPITAL]
    chunks = grpc_chat(sup, "smol", conversation, max_tokens=60)
    text = "".join(c.text for c in chunks)
    assert "Paris" in text and "<|im_end|>" not in text
    last = chunks[-1]
    assert last.finish_reason == runner_pb2.FINISH_REASON_STOP and last.stats.generated_tokens < 60
    assert last.stats.prompt_tokens > 20  # the template's system message and turn markers
    assert last.stats.cached_tokens == 0  # nothing was cached yet
    # The same conversation again: its whole prompt is cached but the last token, which must be run.
    again = grpc_chat(sup, "smol", conversation, max_tokens=60)
    assert "".join(c.text for c in again) == text
    assert again[-1].stats.prompt_tokens == last.stats.prompt_tokens
    assert again[-1].stats.cached_tokens == last.stats.prompt_tokens - 1


def test_grpc_chat_errors_name_the_problem(sup):
    with pytest.raises(grpc.RpcError) as caught:
        grpc_chat(sup, "pair", CAPITAL, max_tokens=5)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "no chat template" in caught.value.details()
    with pytest.raises(grpc.RpcError) as caught:
        grpc_chat(sup, "smol", [{"role": "wizard", "content": "hi"}], max_tokens=5)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'wizard'" in caught.value.details()
    with pytest.raises(grpc.RpcError) as caught:
        grpc_chat(sup, "smol", CAPITAL, max_tokens=5, prompt="also a prompt")
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "messages" in caught.value.details()


def test_a_huge_prompt_is_refused_before_it_is_tokenized(sup):
    prompt = "word " * (int(7.9 * 2**20) // 5)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as caught:
        list(sup.client.generate(timeout=60, model="pair", prompt=prompt, max_tokens=4))
    assert (
        caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "do not fit the context" in caught.value.details()
    )
    assert time.monotonic() - started < 3.0


# -- the OpenAI client -----------------------------------------------------------------------------------


def test_chat_completion_answers_with_usage_and_speculation_figures(client):
    answer = client.chat.completions.create(model="smol", messages=CAPITAL, temperature=0, max_tokens=60)
    choice = answer.choices[0]
    assert "Paris" in choice.message.content and choice.message.role == "assistant"
    assert choice.finish_reason == "stop" and answer.object == "chat.completion" and answer.model == "smol"
    usage = answer.usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens and usage.completion_tokens > 0
    # Cold, or what an earlier conversation on this shared supervisor had in common with this one (the chat
    # template's system turn; after the gRPC test, this very prompt): never the whole prompt, whose last token
    # is always run to get the next one. Which tests ran before depends on how make test's workers split them.
    assert 0 <= usage.prompt_tokens_details.cached_tokens <= usage.prompt_tokens - 1
    assert answer.model_extra["x_mlxserve"]["drafter"] in ("none", "ngram", "model")


def test_streamed_chat_equals_the_whole_answer_and_ends_with_usage(client):
    whole = client.chat.completions.create(model="smol", messages=CAPITAL, temperature=0, max_tokens=40)
    events = list(
        client.chat.completions.create(
            model="smol",
            messages=CAPITAL,
            temperature=0,
            max_tokens=40,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert events[0].choices[0].delta.role == "assistant"
    text = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
    assert text == whole.choices[0].message.content
    finishes = [e.choices[0].finish_reason for e in events if e.choices and e.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert events[-1].choices == [] and events[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completion_max_tokens_gives_length_and_stop_cuts_the_text(client):
    plain = client.completions.create(model="pair", prompt=PROMPT, max_tokens=30, temperature=0)
    choice = plain.choices[0]
    assert choice.finish_reason == "length" and plain.usage.completion_tokens == 30
    assert plain.model_extra["x_mlxserve"]["drafted"] > 0  # the pair speculates
    stop = choice.text[10:16]
    stopped = client.completions.create(model="pair", prompt=PROMPT, max_tokens=30, temperature=0, stop=[stop, "\x00"])
    assert (
        stopped.choices[0].finish_reason == "stop" and stopped.choices[0].text == choice.text[: choice.text.index(stop)]
    )
    streamed = client.completions.create(model="pair", prompt=PROMPT, max_tokens=30, temperature=0, stream=True)
    assert "".join(e.choices[0].text for e in streamed if e.choices) == choice.text


def test_seed_makes_sampling_reproducible(client):
    def sample(seed):
        return (
            client.completions.create(model="pair", prompt=PROMPT, max_tokens=40, temperature=1.0, seed=seed)
            .choices[0]
            .text
        )

    first, again = sample(7), sample(7)
    assert first == again
    assert any(sample(seed) != first for seed in (8, 9, 10))


def test_logprobs_come_from_the_target_with_speculation_on(client):
    answer = client.completions.create(model="pair", prompt=PROMPT, max_tokens=20, temperature=0, logprobs=3)
    lp = answer.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 20
    assert "".join(lp.tokens) == answer.choices[0].text
    assert answer.model_extra["x_mlxserve"]["drafted"] > 0
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and len(top) == 3
        assert max(top.values()) == pytest.approx(value, abs=1e-4)  # greedy picks the most likely token
    chat = client.chat.completions.create(
        model="smol", messages=CAPITAL, temperature=0, max_tokens=12, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(
        len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        for entry in content
    )


def test_a_repeated_conversation_comes_from_the_prompt_cache(sup, client):
    messages = [{"role": "system", "content": "You answer in one short sentence. " * 20}] + CAPITAL
    first = client.chat.completions.create(model="smol", messages=messages, temperature=0, max_tokens=30)
    second = client.chat.completions.create(model="smol", messages=messages, temperature=0, max_tokens=30)
    assert second.choices[0].message.content == first.choices[0].message.content
    assert second.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens - 1
    assert (
        second.model_extra["x_mlxserve"]["time_to_first_token_s"]
        < first.model_extra["x_mlxserve"]["time_to_first_token_s"]
    )
    cache = sup.client.model("smol").memory.prompt_cache
    assert wait_until(lambda: sup.client.model("smol").memory.prompt_cache.hits >= 1, 5)
    assert cache.entries >= 1 and 0 < cache.bytes <= cache.budget
    metrics = sup.probe("/metrics")[1]
    for name in ("entries", "bytes", "hits", "reused_tokens", "evictions"):
        assert f'mlxserve_prompt_cache_{name}{{model="smol"}}' in metrics


def test_models_list_and_retrieve(client):
    listed = {m.id: m for m in client.models.list()}
    assert set(listed) == {"smol", "pair", "busy", "claude"}
    assert listed["smol"].context_length == listed["smol"].max_model_len == 8192  # what a client may plan by
    assert client.models.retrieve("smol").id == "smol"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_errors_arrive_as_the_sdks_exceptions_in_openais_shape(sup, client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="smol", messages=CAPITAL, temperature="hot")
    assert caught.value.body["param"] == "temperature" and caught.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="smol", messages=CAPITAL, n=17)  # 16 choices at most
    assert caught.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="pair", messages=CAPITAL)
    assert "no chat template" in caught.value.body["message"]
    with pytest.raises(openai.AuthenticationError):
        sup.openai(api_key="wrong").models.list()
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4o", messages=CAPITAL)
    assert "gpt-4o" in caught.value.body["message"] and caught.value.body["param"] == "model"
    answer = client.completions.create(model="pair", prompt="x", max_tokens=2, extra_body={"frobnicate": [1, 2]})
    assert answer.usage.completion_tokens <= 2  # unknown fields are ignored


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"extra_body": {"best_of": 3}}, "best_of"),
        ({"prediction": {"type": "content", "content": "Paris"}}, "prediction"),
        ({"functions": [{"name": "f", "parameters": {"type": "object"}}]}, "functions"),
    ],
)
def test_a_field_the_server_cannot_honour_is_refused_not_ignored(client, fields, param):
    """A field this server does not honour is a 400 naming it: the answer would otherwise not be what was
    asked for, and nothing would say so."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="smol", messages=CAPITAL, max_tokens=4, **fields)
    assert caught.value.status_code == 400 and caught.value.body["param"] == param
    assert "not supported" in caught.value.body["message"]


def test_neutral_values_are_served(client):
    """Values that ask for nothing are served as usual."""
    answer = client.chat.completions.create(
        model="smol",
        messages=CAPITAL,
        max_tokens=4,
        temperature=0,
        tools=[],
        tool_choice="none",
        response_format={"type": "text"},
        presence_penalty=0,
        frequency_penalty=0.0,
        logit_bias={},
    )
    assert answer.choices[0].message.content


def test_logit_bias_steers_the_answer_and_bad_keys_are_a_400(client):
    answer = client.completions.create(
        model="pair",
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        logit_bias={"100": 100},
        extra_body={"ignore_eos": True},
    )
    text = answer.choices[0].text
    piece = text[: len(text) // 6]
    assert piece and text == piece * 6  # token 100, six times
    for bias, param in (({"x": 1}, "logit_bias"), ({"²": 1}, "logit_bias"), ({"100": 10**400}, "logit_bias")):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model="pair", prompt=PROMPT, max_tokens=2, logit_bias=bias)
        assert caught.value.body["param"] == param


def test_a_full_queue_is_429(client):
    # "busy" lets nobody wait: while one generation runs, the next request is refused at once.
    running = client.completions.create(
        model="busy", prompt=PROMPT, max_tokens=3000, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(running))
    try:
        with pytest.raises(openai.RateLimitError) as caught:
            client.completions.create(model="busy", prompt=PROMPT, max_tokens=5)
        assert "already waiting" in caught.value.body["message"]
    finally:
        running.close()


# -- raw HTTP --------------------------------------------------------------------------------------------


def test_sse_framing(sup):
    body = {"model": "pair", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stream": True}
    with httpx.stream(
        "POST", f"{sup.base_url}/completions", json=body, timeout=60, headers={"Authorization": f"Bearer {TOKEN}"}
    ) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        raw = "".join(response.iter_text())
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = []
    for event in events[:-2]:
        assert event.startswith("data: ") and "\n" not in event
        chunks.append(json.loads(event.removeprefix("data: ")))
        assert chunks[-1]["object"] == "text_completion"
    # The answer came before [DONE]: its text, then one finish_reason, on the last chunk.
    assert chunks, "a stream of nothing but [DONE]"
    whole = httpx.post(
        f"{sup.base_url}/completions",
        json={**body, "stream": False},
        timeout=60,
        headers={"Authorization": f"Bearer {TOKEN}"},
    ).json()["choices"][0]
    assert whole["finish_reason"] == "length" and whole["text"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]


def test_error_shape_over_raw_http(sup):
    response = httpx.post(
        f"{sup.base_url}/chat/completions",
        content=b"{not json",
        timeout=10,
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "invalid_argument"
    response = httpx.get(f"{sup.base_url}/models", timeout=10)
    assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"


def test_a_client_that_disconnects_frees_the_runner(sup):
    body = {"model": "pair", "prompt": PROMPT, "max_tokens": 4000, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream(
        "POST", f"{sup.base_url}/completions", json=body, timeout=60, headers={"Authorization": f"Bearer {TOKEN}"}
    ) as response:
        lines = response.iter_lines()
        for _ in range(5):
            next(lines)
    # The 4000-token generation would take many seconds more; the runner is free at once.
    assert wait_until(lambda: sup.client.model("pair").in_flight == 0, 5)
    started = time.monotonic()
    chunks = list(sup.client.generate(timeout=30, model="pair", prompt="x", max_tokens=5, ignore_eos=True))
    assert chunks[-1].stats.generated_tokens == 5
    assert chunks[-1].stats.time_to_first_token_s < 1.0 and time.monotonic() - started < 5


# -- the terminal chat -----------------------------------------------------------------------------------


def test_terminal_chat_keeps_the_conversation_and_stops_an_answer_on_ctrl_c(sup):
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "supervisor",
            "chat",
            "--model",
            "smol",
            "--address",
            f"127.0.0.1:{sup.port}",
            "--token",
            TOKEN,
            "--max-tokens",
            "400",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        bufsize=1,
        env=child_environment(),
    )
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(iter(lambda: process.stdout.read(1), "")), daemon=True)
    reader.start()

    def seen(text, count=1):
        return wait_until(lambda: "".join(output).count(text) >= count, 120, interval=0.05)

    try:
        assert seen(">>> ")
        process.stdin.write("What is the capital of France?\n")
        process.stdin.flush()
        assert seen(" tok/s"), "".join(output)
        assert "Paris" in "".join(output)
        assert seen(">>> ", 2)
        process.stdin.write("Write a long story about the history of that city.\n")
        process.stdin.flush()
        before = len("".join(output))
        assert wait_until(lambda: len("".join(output)) > before + 40, 60, interval=0.05)
        process.send_signal(signal.SIGINT)  # Ctrl-C: stop the answer, stay in the chat
        assert seen("[stopped]"), "".join(output)
        assert seen(">>> ", 3)
        process.stdin.write("/bye\n")
        process.stdin.flush()
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
    assert wait_until(lambda: sup.client.model("smol").in_flight == 0, 5)


def test_terminal_chat_leaves_on_end_of_input(sup):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "supervisor",
            "chat",
            "--model",
            "smol",
            "--address",
            f"127.0.0.1:{sup.port}",
            "--token",
            TOKEN,
        ],
        input="",
        capture_output=True,
        text=True,
        timeout=60,
        env=child_environment(),
    )
    assert done.returncode == 0 and "chatting with smol" in done.stdout


def test_terminal_chat_loads_its_model_first_with_a_progress_line(sup):
    """A model that is not loaded is loaded before the first prompt, with a line saying so (on a terminal)."""
    sup.client.unload_model("busy")
    assert sup.client.model("busy").state == supervisor_pb2.RUNNER_STATE_STOPPED
    args = [sys.executable, "-m", "supervisor", "chat", "--model", "busy", "--address", f"127.0.0.1:{sup.port}"]
    env = child_environment() | {"TERM": "xterm-256color", "COLUMNS": "100"}
    status, screen = on_a_terminal(args + ["--token", TOKEN], env, [(">>> ", "/bye\n")])
    assert status == 0, screen
    assert "loading busy" in screen and screen.index("loading busy") < screen.index(">>> ")
    assert sup.client.model("busy").state == supervisor_pb2.RUNNER_STATE_SERVING
    assert sup.client.model("busy").last_load_s > 0


def test_terminal_chat_spins_while_the_prompt_is_read_on_a_terminal_only(sup):
    """On a terminal a spinner runs until the first token (and clears itself); through a pipe nothing of it."""
    args = [sys.executable, "-m", "supervisor", "chat", "--model", "smol", "--address", f"127.0.0.1:{sup.port}"]
    args += ["--token", TOKEN, "--max-tokens", "8"]
    env = child_environment() | {"TERM": "xterm-256color", "COLUMNS": "100"}
    status, screen = on_a_terminal(args, env, [(">>> ", "What is the capital of France?\n"), (" tok/s", "/bye\n")])
    assert status == 0, screen
    assert "reading the prompt" in screen and " tok/s" in screen
    piped = subprocess.run(
        args, input="What is the capital of France?\n/bye\n", capture_output=True, text=True, timeout=120, env=env
    )
    assert piped.returncode == 0 and " tok/s" in piped.stdout
    assert "reading the prompt" not in piped.stdout + piped.stderr and "\x1b[" not in piped.stdout + piped.stderr


# -- hostile requests: one judge of the fields, one wording, never a 5xx ------------------------------------


def raw_post(sup, path: str, content: bytes) -> httpx.Response:
    return httpx.post(
        f"{sup.base_url}/{path}",
        content=content,
        timeout=60,
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
    )


@pytest.mark.parametrize(
    "path, body, param, words",
    [
        # A number past what the message's field holds (it was a bare 500).
        (
            "completions",
            {"model": "pair", "prompt": "x", "max_tokens": 10**12},
            "max_tokens",
            "must lie in [1, 2147483647]",
        ),
        ("completions", {"model": "pair", "prompt": "x", "top_k": 10**12}, "top_k", "must lie in [0, 2147483647]"),
        ("completions", {"model": "pair", "prompt": [2**40]}, "prompt_ids", "token ids must lie in [0, 2147483647]"),
        ("completions", {"model": "pair", "prompt": "x", "seed": -1}, "seed", "must lie in [0, 2**63)"),
        ("completions", {"model": "pair", "prompt": "x", "max_tokens": 0}, "max_tokens", "must lie in [1, "),
        ("chat/completions", {"model": "smol", "messages": CAPITAL, "top_p": 1.5}, "top_p", "must lie in (0, 1]"),
        (
            "chat/completions",
            {"model": "smol", "messages": CAPITAL, "top_logprobs": 3},
            "top_logprobs",
            "needs logprobs",
        ),
        (
            "chat/completions",
            {"model": "smol", "messages": [{"role": "wizard", "content": "hi"}]},
            "messages",
            "role 'wizard' is not one of",
        ),
        ("chat/completions", {"model": "smol", "messages": CAPITAL, "drafter": "oracle"}, "drafter", "must be one of"),
    ],
)
def test_a_field_out_of_range_is_a_400_naming_it(sup, path, body, param, words):
    response = raw_post(sup, path, json.dumps(body).encode())
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"] and error["type"] == "invalid_request_error"


def test_the_grpc_api_refuses_the_same_field_in_the_same_words(sup):
    with pytest.raises(grpc.RpcError) as caught:
        list(
            sup.client.stub.Generate(
                supervisor_pb2.GenerateRequest(model="pair", prompt="x", max_tokens=5, top_p=1.5),
                timeout=30,
                metadata=sup.client.metadata,
            )
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    http = raw_post(sup, "completions", json.dumps({"model": "pair", "prompt": "x", "top_p": 1.5}).encode())
    assert caught.value.details() == http.json()["error"]["message"] == "top_p: must lie in (0, 1]"


@pytest.mark.parametrize(
    "content",
    [
        b'{"model": "smol", "messages": [{"role": "user", "content": "\\ud800"}]}',  # a lone surrogate (was a 500)
        b'{"model": "\\udfff", "prompt": "x"}',
        b'{"model": "pair", "prompt": "x", "stop": ["\\ud800"]}',
        b'{"model": "pair", "prompt": "x", "temperature": 1e400}',  # JSON's number too big for a float: inf
        b'{"model": "pair", "prompt": "x", "max_tokens": 1.5}',
        b'{"model": "pair", "prompt": null}',
        b'{"model": "pair", "prompt": {"a": 1}}',
        b'{"model": "smol", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
        b'{"model": "smol", "messages": "hello"}',
        b"[1, 2, 3]",
        b'"just a string"',
        b"{}",
        b"",
        b"\xff\xfe\x00",
    ],
)
def test_no_malformed_body_gets_a_5xx(sup, content):
    for path in ("completions", "chat/completions"):
        response = raw_post(sup, path, content)
        assert response.status_code == 400, (path, response.status_code, response.text)
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_a_prompt_too_big_to_reach_the_runner_is_a_400_that_says_so(sup, client):
    """Not a 429 (which OpenAI's clients retry by themselves) with gRPC's transport text."""
    huge = "word " * (2 * 2**20)  # 10 MB: more than a message to the runner may carry
    response = raw_post(sup, "completions", json.dumps({"model": "pair", "prompt": huge}).encode())
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["param"] == "prompt" and "the prompt is too long" in error["message"]
    assert "CLIENT" not in error["message"] and "larger than max" not in error["message"]
    with pytest.raises(openai.BadRequestError):
        client.with_options(max_retries=0).chat.completions.create(
            model="smol", messages=[{"role": "user", "content": huge}]
        )


def test_chat_template_arguments_keep_their_types(sup):
    """An integer stays an integer on its way to the chat template (it became 2.0 through a protobuf Struct)."""
    from common.requests import template_kwargs

    request = supervisor_pb2.GenerateRequest(chat_template_kwargs=json.dumps({"n": 2, "on": True, "x": [1, "a"]}))
    forwarded = runner_pb2.GenerateRequest.FromString(request.SerializeToString())
    assert template_kwargs(forwarded.chat_template_kwargs) == {"n": 2, "on": True, "x": [1, "a"]}
    assert type(template_kwargs(forwarded.chat_template_kwargs)["n"]) is int
    answer = raw_post(
        sup,
        "chat/completions",
        json.dumps({"model": "smol", "messages": CAPITAL, "max_tokens": 3, "chat_template_kwargs": {"n": 2}}).encode(),
    )
    assert answer.status_code == 200, answer.text


def test_the_json_log_is_one_record_a_line_with_the_model_and_pid(sup):
    """This supervisor runs with log_format = "json", as a log collector wants it."""
    smol_pid = sup.client.model("smol").pid
    entries = [json.loads(line) for line in sup.stderr.splitlines() if line.strip()]
    assert entries and all({"time", "level", "process", "model", "pid", "message"} <= set(e) for e in entries)
    served = [e for e in entries if e["process"] == "runner" and e["model"] == "smol" and e["pid"] == smol_pid]
    assert any(e["message"].startswith("serving smol after") for e in served)
    assert any(e["process"] == "supervisor" and "listening on" in e["message"] for e in entries)


def test_a_refused_request_leaves_a_line_saying_who_and_why(sup):
    """Which API, the model, the request's id (the x-request-id its client got), the status and the reason; the
    gRPC API's too. And no tokenizer warning about "indexing errors" for a prompt that was only counted."""
    refused = raw_post(sup, "chat/completions", json.dumps({"model": "smol", "messages": CAPITAL, "n": 0}).encode())
    request_id = refused.headers["x-request-id"]
    assert refused.status_code == 400 and request_id.startswith("http-")
    with pytest.raises(grpc.RpcError):
        list(sup.client.generate(timeout=60, model="smol", prompt="hi", max_tokens=0, request_id="grpc-refused-1"))
    sup.anthropic().messages.count_tokens(model="smol", messages=[{"role": "user", "content": "word " * 9000}])

    def lines() -> list[str]:
        return [json.loads(line)["message"] for line in sup.stderr.splitlines() if line.strip()]

    wanted = f"refused POST /v1/chat/completions (OpenAI API, model 'smol', request {request_id}): 400 n: must lie"
    assert wait_until(lambda: any(line.startswith(wanted) for line in lines()), 10), lines()[-5:]
    grpc_line = "refused gRPC /mlxserve.v1.Supervisor/Generate (model 'smol', request grpc-refused-1): INVALID_ARGUMENT"
    assert any(line.startswith(grpc_line) for line in lines()), lines()[-5:]
    assert not any("indexing errors" in line for line in lines())


def test_the_fields_todays_clients_send_are_taken_or_refused_naming_them(client):
    """Hints are taken and change nothing (nothing is stored for later listing; the prompt cache finds a prefix
    by itself); what asks for a behaviour no model here has is a 400 naming the field."""
    hints = {
        "store": True,
        "metadata": {"app": "test"},
        "prompt_cache_key": "session-1",
        "safety_identifier": "user-1",
        "service_tier": "auto",
        "verbosity": "medium",
        "reasoning_effort": "none",
    }
    answer = client.chat.completions.create(
        model="smol", messages=CAPITAL, max_tokens=4, temperature=0, extra_body=hints
    )
    assert answer.choices[0].message.content is not None
    for field, value in (("verbosity", "low"), ("reasoning_effort", "high"), ("web_search_options", {})):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="smol", messages=CAPITAL, max_tokens=4, extra_body={field: value})
        assert caught.value.body["param"] == field
