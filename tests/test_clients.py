"""Real clients as they are, against the shared chat supervisor (SmolLM2, 8,192 tokens of context): Claude Code
from npm completes a turn; a prompt past the context is the error each client recognises (the official SDKs,
LiteLLM's ContextWindowExceededError); the OpenAI Agents SDK goes on after a tool call cut by max_tokens;
Ollama's client finds Ollama's root. Issue #36.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.helpers import CHAT_TOKEN

CLAUDE = Path(__file__).resolve().parents[1] / ".clients" / "node_modules" / ".bin" / "claude"
# More than SmolLM2's 8,192 tokens of context, whatever the layout.
TOO_LONG = "word " * 9000
ASK = [{"role": "user", "content": "What is the capital of France?"}]


def claude_code(supervisor, home: Path, *flags: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``claude -p`` against the supervisor, as a user runs it (docs/clients.md), with a home of its own."""
    assert CLAUDE.exists(), f"{CLAUDE} is missing: run `make clients`"
    env = {
        **os.environ,
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": supervisor.base_url.removesuffix("/v1"),
        "ANTHROPIC_API_KEY": CHAT_TOKEN,
        "ANTHROPIC_MODEL": "claude",
        "ANTHROPIC_SMALL_FAST_MODEL": "claude",
        "DISABLE_TELEMETRY": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
    }
    command = [str(CLAUDE), "-p", "What is the capital of France?", "--model", "claude", *flags]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd=home)


def test_claude_code_completes_a_turn_with_a_prompt_that_fits(chat_supervisor, tmp_path):
    """Its default prompt (~21k tokens) cannot fit SmolLM2: it is told so at once, in the words it knows, and
    says so; with no tools and a short system prompt, the smallest flags that fit, the turn completes."""
    started = time.monotonic()
    refused = claude_code(chat_supervisor, tmp_path)
    assert "Prompt is too long" in refused.stdout + refused.stderr, (refused.stdout, refused.stderr)
    assert time.monotonic() - started < 60
    answered = claude_code(
        chat_supervisor, tmp_path, "--tools", "", "--system-prompt", "You are a helpful assistant. Be brief."
    )
    assert answered.returncode == 0 and answered.stdout.strip(), (answered.stdout, answered.stderr)
    assert "API Error" not in answered.stdout + answered.stderr


def test_a_prompt_past_the_context_is_the_error_each_sdk_knows(chat_supervisor, chat_client):
    with pytest.raises(openai.BadRequestError) as chat:
        chat_client.chat.completions.create(model="smol", messages=[{"role": "user", "content": TOO_LONG}])
    assert chat.value.code == "context_length_exceeded" and chat.value.param == "messages"
    assert "maximum context length is 8192 tokens" in chat.value.message
    with pytest.raises(openai.BadRequestError) as completion:
        chat_client.completions.create(model="smol", prompt=TOO_LONG, max_tokens=4)
    assert completion.value.code == "context_length_exceeded" and completion.value.param == "prompt"
    with pytest.raises(openai.BadRequestError) as responses:
        chat_client.responses.create(model="smol", input=TOO_LONG)
    assert responses.value.code == "context_length_exceeded" and responses.value.param == "input"
    claude = chat_supervisor.anthropic()
    with pytest.raises(anthropic.BadRequestError) as message:
        claude.messages.create(model="smol", max_tokens=8, messages=[{"role": "user", "content": TOO_LONG}])
    assert message.value.body["error"]["message"].startswith("prompt is too long: ")
    counted = claude.messages.count_tokens(model="smol", messages=[{"role": "user", "content": TOO_LONG}])
    assert counted.input_tokens > 8192  # counted, not refused: Claude Code's /context needs the size
    import ollama

    with pytest.raises(ollama.ResponseError) as ollamas:
        chat_supervisor.ollama().chat(model="smol", messages=[{"role": "user", "content": TOO_LONG}])
    assert ollamas.value.status_code == 400
    assert "exceeds the available context size (8192 tokens), try increasing it" in ollamas.value.error


def test_litellm_raises_its_context_window_error(chat_supervisor):
    """Through openai/ and anthropic/, LiteLLM's ContextWindowExceededError (its context fallbacks fire). Its
    ollama providers map no error to it, whatever the words (LiteLLM's own mapping): they get Ollama's words."""
    import litellm

    root = chat_supervisor.base_url.removesuffix("/v1")
    too_long = [{"role": "user", "content": TOO_LONG}]
    for model, base in (("openai/smol", chat_supervisor.base_url), ("anthropic/smol", root)):
        with pytest.raises(litellm.ContextWindowExceededError):
            litellm.completion(model=model, api_base=base, api_key=CHAT_TOKEN, messages=too_long, max_tokens=4)
    for model in ("ollama_chat/smol", "ollama/smol"):
        with pytest.raises(litellm.BadRequestError) as caught:
            litellm.completion(
                model=model,
                api_base=root,
                messages=too_long,
                max_tokens=4,
                extra_headers={"Authorization": f"Bearer {CHAT_TOKEN}"},
            )
        assert "exceeds the available context size" in str(caught.value)


def test_an_agent_goes_on_after_a_tool_call_cut_by_max_tokens(chat_supervisor):
    """The OpenAI Agents SDK, streamed: the call comes cut (finish_reason length), the tool's run fails on its
    arguments, and the history holding the cut call is served (it was a 400), so the agent answers."""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    ran = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        ran.append(city)
        return f"Sunny in {city}"

    client = openai.AsyncOpenAI(base_url=chat_supervisor.base_url, api_key=CHAT_TOKEN)
    agent = Agent(
        name="weather",
        instructions="Use the tools.",
        tools=[get_weather],
        model=OpenAIChatCompletionsModel(model="smol", openai_client=client),
        model_settings=ModelSettings(max_tokens=18, tool_choice="required", temperature=0),
    )

    async def run():
        result = Runner.run_streamed(agent, "What is the weather in Bakkebøl?", max_turns=3)
        async for _ in result.stream_events():
            pass
        return result

    result = asyncio.run(run())
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds[:2] == ["ToolCallItem", "ToolCallOutputItem"] and "MessageOutputItem" in kinds, kinds
    assert not ran  # its arguments were cut: the tool never ran with half of them
    assert result.final_output is not None


def test_ollamas_root_answers_as_ollama_on_both_addresses(chat_supervisor):
    for host in (f"http://127.0.0.1:{chat_supervisor.http_port}", f"http://{chat_supervisor.ollama_listen}"):
        client = chat_supervisor.ollama(host=host)._client  # the ollama client's own connection
        answer = client.get("/")
        assert answer.status_code == 200 and answer.text == "Ollama is running"
        assert client.head("/").status_code == 200
    assert httpx.get(f"http://{chat_supervisor.ollama_listen}/").text == "Ollama is running"  # no token needed
