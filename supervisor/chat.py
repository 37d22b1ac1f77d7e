"""python -m supervisor chat --model NAME: a terminal chat with one model through the supervisor.

The conversation is kept and sent whole each turn (the model's chat template
lays it out). Answers stream as they come; after each one a line gives its
tokens, tokens per second and draft acceptance. ``/bye`` or Ctrl-D leaves;
Ctrl-C stops the answer being written (what was written stays in the
conversation) without leaving; ``/clear`` starts the conversation again.
On a terminal, a spinner runs while the prompt is read (a long one prefills
for seconds) and clears itself when the first token arrives.
"""

from __future__ import annotations

import contextlib
import itertools
import signal
import sys
import threading

import grpc

from common.progress import spinner

from .client import SupervisorClient, loading_line
from .protocol import supervisor_pb2

PROMPT = ">>> "
HELP = "commands: /bye (or Ctrl-D) leaves, /clear forgets the conversation; Ctrl-C stops an answer"


@contextlib.contextmanager
def ctrl_c_cancels(call):
    """While the answer streams, Ctrl-C cancels ``call`` (its iteration then ends with CANCELLED) and sets the
    event this yields. A handler rather than KeyboardInterrupt: the exception can land anywhere, a finaliser
    or a callback included, where it is swallowed and the answer goes on."""
    stopped = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stopped
        return

    def on_ctrl_c(signum, frame):
        stopped.set()
        threading.Thread(target=call.cancel, daemon=True).start()  # not from inside whatever was interrupted

    previous = signal.signal(signal.SIGINT, on_ctrl_c)
    try:
        yield stopped
    finally:
        signal.signal(signal.SIGINT, previous)


def stats_line(stats) -> str:
    line = f"[{stats.generated_tokens} tokens, {stats.tokens_per_second:.1f} tok/s"
    if stats.drafted:
        line += f", acceptance {stats.acceptance_rate:.2f} ({stats.drafter or 'draft'})"
    if stats.cached_tokens:
        line += f", {stats.cached_tokens} prompt tokens from the cache"
    return line + "]"


class Chat:
    def __init__(
        self,
        client: SupervisorClient,
        model: str,
        system: str = "",
        max_tokens: int = 1024,
        temperature: float = 0.0,
        out=sys.stdout,
    ):
        self.client = client
        self.model = model
        self.system = system
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.out = out
        self.messages: list[tuple[str, str]] = []
        self.clear()

    def clear(self) -> None:
        self.messages = [("system", self.system)] if self.system else []

    def request(self) -> supervisor_pb2.GenerateRequest:
        request = supervisor_pb2.GenerateRequest(
            model=self.model, max_tokens=self.max_tokens, temperature=self.temperature, request_id="chat"
        )
        for role, content in self.messages:
            request.messages.add(role=role, content=content)
        return request

    def turn(self, text: str) -> None:
        """Send one user message and stream the answer; Ctrl-C stops it and keeps what came."""
        self.messages.append(("user", text))
        call = self.client.stub.Generate(self.request(), metadata=self.client.metadata)
        answer, last = [], None
        try:
            with ctrl_c_cancels(call) as stopped:
                with spinner("reading the prompt", file=self.out):  # a long prompt prefills: until the first token
                    chunks = iter(call)
                    first = next(chunks, None)
                for last in itertools.chain([first] if first is not None else [], chunks):
                    answer.append(last.text)
                    self.out.write(last.text)
                    self.out.flush()
        except grpc.RpcError as error:
            if not stopped.is_set():
                self.messages.pop()
                self.out.write(f"\n[error: {error.code().name}: {error.details()}]\n")
                return
            self.out.write("\n[stopped]\n")
        else:
            self.out.write(
                "\n" + (stats_line(last.stats) if last is not None and last.HasField("stats") else "") + "\n"
            )
        self.messages.append(("assistant", "".join(answer)))
        self.out.flush()

    def run(self, read=input) -> int:
        self.out.write(f"chatting with {self.model}; {HELP}\n")
        while True:
            try:
                self.out.write(PROMPT)
                self.out.flush()
                line = read()
            except EOFError:
                self.out.write("\n")
                return 0
            except KeyboardInterrupt:
                self.out.write("\nUse Ctrl-D or /bye to leave.\n")
                continue
            text = line.strip()
            if not text:
                continue
            if text == "/bye":
                return 0
            if text == "/clear":
                self.clear()
                self.out.write("[conversation cleared]\n")
                continue
            if text.startswith("/"):
                self.out.write(f"unknown command {text.split()[0]}; {HELP}\n")
                continue
            self.turn(text)


def wait_loaded(client: SupervisorClient, model: str, out=sys.stdout) -> None:
    """Load ``model`` if it is not serving, with a line saying how far its load has got (on a terminal)."""
    if not model or client.model(model).state == supervisor_pb2.RUNNER_STATE_SERVING:
        return

    def load() -> None:
        with contextlib.suppress(grpc.RpcError):  # a load that fails: the first turn says why
            client.load_model(model)

    loading = threading.Thread(target=load, daemon=True)
    loading.start()
    with spinner(f"loading {model}", file=out) as update:
        while loading.is_alive():
            status = client.model(model)
            if status.state == supervisor_pb2.RUNNER_STATE_STARTING:
                update(loading_line(status))
            loading.join(0.25)


def main(args) -> int:
    with SupervisorClient(args.address, token=args.token) as client:
        try:
            wait_loaded(client, args.model)
        except (grpc.RpcError, StopIteration):  # no such model, or the supervisor is not there: the chat says so
            pass
        chat = Chat(client, args.model, system=args.system, max_tokens=args.max_tokens, temperature=args.temperature)
        return chat.run()
