"""The supervisor's command line.

python -m supervisor serve [--config FILE] | chat --model NAME | generate --model NAME PROMPT
                     | models | memory | status | top [--once] | estimate [REPO] | pull REPO
                     | worker --model NAME [--rank R] | lws-hostfile OUT --port P
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

import grpc

from common import logs

from .config import DEFAULT_LISTEN, ConfigError, default_config, from_dict, load

SAMPLE_PROMPT = "The for statement is used to iterate over the elements of a sequence"
SAMPLE_QUESTION = "What is the capital of France?"


def serve(args) -> int:
    try:
        config = load(args.config) if args.config else default_config()
    except ConfigError as error:
        print(f"supervisor: {error}", file=sys.stderr)
        return 2
    console = logs.setup("supervisor", config.log_format)
    from .service import Supervisor

    # Handlers first, so a SIGTERM during start-up still shuts down cleanly. They only
    # append to a list: taking a lock in a handler can deadlock the thread it interrupted.
    signalled: list[int] = []
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda signum, frame: signalled.append(signum))
    try:
        supervisor = Supervisor(config)
        supervisor.start()
    except (OSError, RuntimeError, ConfigError) as error:
        print(f"supervisor: {error}", file=sys.stderr)
        return 2
    if (
        args.sample_request
        and supervisor.scheduler.runners[next(iter(config.models))].wait_serving(config.startup_timeout).name
        == "SERVING"
    ):
        console.pause()  # the answers in one block; the log lines written meanwhile come after it
        try:
            answer_sample_request(config.listen, next(iter(config.models)))
            if "smollm2" in config.models and config.http_listen:
                answer_sample_chat(config.http_listen, "smollm2")
            print("--- serving until Ctrl-C\n", flush=True)
        finally:
            console.resume()
    supervisor.serve_until(lambda: bool(signalled))
    return 0


def answer_sample_request(address: str, model: str) -> None:
    from .client import SupervisorClient

    with SupervisorClient(address) as client:
        print(f"\n--- sample request to model {model!r} at {address}:\n{SAMPLE_PROMPT}", flush=True)
        last = None
        for last in client.generate(model=model, prompt=SAMPLE_PROMPT, max_tokens=120, timeout=300):
            print(last.text, end="", flush=True)
        s = last.stats
        print(
            f"\n--- {s.generated_tokens} tokens, {s.tokens_per_second:.0f} tok/s, acceptance {s.acceptance_rate:.2f} "
            f'(python -m supervisor generate --model {model} "...")\n',
            flush=True,
        )


def answer_sample_chat(http_listen: str, model: str) -> None:
    """One chat question to the real model through the OpenAI-compatible HTTP API (the model loads on demand)."""
    import json
    import urllib.request

    body = {
        "model": model,
        "messages": [{"role": "user", "content": SAMPLE_QUESTION}],
        "temperature": 0,
        "max_tokens": 60,
    }
    url = f"http://{http_listen}/v1/chat/completions"
    print(f"--- sample chat to model {model!r}: POST {url}\n{SAMPLE_QUESTION}", flush=True)
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            answer = json.load(response)
    except OSError as error:
        print(f"--- the sample chat failed: {error}", flush=True)
        return
    usage, extra = answer["usage"], answer["x_mlxserve"]
    print(answer["choices"][0]["message"]["content"])
    print(
        f"--- {usage['completion_tokens']} tokens, {extra['tokens_per_second']:.0f} tok/s "
        f"(python -m supervisor chat --model {model})\n",
        flush=True,
    )


def client_command(args) -> int:
    from .client import SupervisorClient, format_models

    try:
        with SupervisorClient(args.address, token=args.token) as client:
            if args.command == "generate":
                last = None
                for last in client.generate(
                    model=args.model,
                    prompt=args.prompt,
                    max_tokens=args.max_tokens,
                    temperature=args.temperature,
                    timeout=args.timeout,
                ):
                    sys.stdout.write(last.text)
                    sys.stdout.flush()
                if last is not None and last.HasField("stats"):
                    s = last.stats
                    print(
                        f"\n[{s.generated_tokens} tokens, {s.tokens_per_second:.0f} tok/s, "
                        f"acceptance {s.acceptance_rate:.2f}]",
                        file=sys.stderr,
                    )
                else:
                    print()
            elif args.command == "models":
                print(format_models(client.list_models().models))
                for name in client.get_status().cached:  # hub repositories a request may name
                    print(f"{name:<16} cached    (in the hub cache; loaded on first request)")
            elif args.command == "memory":
                memory = client.get_memory()
                print(format_models(memory.models, memory=True))
                print(
                    f"system: {memory.system_available / 2**20:.0f} MiB available "
                    f"of {memory.system_total / 2**20:.0f} MiB; "
                    f"supervisor RSS {memory.supervisor_rss / 2**20:.0f} MiB"
                )
            elif args.command == "top":
                from .top import run as top

                return top(client, args.once, args.interval)
            elif args.command == "status":
                status = client.get_status()
                print(
                    f"supervisor {status.version} pid {status.pid}, up {status.uptime_s:.0f} s, "
                    f"{'ready' if status.ready else 'not ready'}, max_loaded {status.max_loaded}"
                )
                print(format_models(status.models))
    except grpc.RpcError as error:
        print(f"error: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    return 0


def estimate_command(args) -> int:
    from .hub import HubError, parse_ref
    from .memory import SUPERVISOR_ALLOWANCE, pod_memory

    try:
        if args.model:  # a hub repository, as a config naming it with the default settings would
            if parse_ref(args.model) is None:
                raise ValueError(f"{args.model!r} is not a hub repository (org/name, org/name@revision)")
            table = {"target": args.model, "load_at_start": False}
            config = from_dict({"models": {"model": table}}, Path.cwd())
        else:
            config = load(args.config) if args.config else default_config()
        total, rows = pod_memory(config)
    except HubError as error:
        print(f"supervisor: {error.message}", file=sys.stderr)
        return 2
    except (ConfigError, OSError, ValueError) as error:
        print(f"supervisor: {error}", file=sys.stderr)
        return 2
    mib = 2**20
    for name, needed, dtype in rows:
        name = args.model or name
        print(
            f"{name}: {needed.total / mib:.0f} MiB ({dtype}: weights {needed.weights / mib:.0f}, "
            f"KV cache {needed.kv_cache / mib:.0f}, prefill {needed.prefill / mib:.0f}, "
            + (f"vision {needed.vision / mib:.0f}, " if needed.vision else "")
            + f"runtime {needed.runtime / mib:.0f})"
        )
    print(f"supervisor: {SUPERVISOR_ALLOWANCE / mib:.0f} MiB")
    print(f"memory request: {-(-total // mib)}Mi")
    return 0


def pull_command(args) -> int:
    """Fetch a hub repository into the hub cache, with a bar on a terminal (a line per step elsewhere)."""
    from common.progress import growing_bar

    from . import hub

    ref = hub.parse_ref(args.model)
    if ref is None:
        print(
            f"supervisor pull: {args.model!r} is not a hub repository (org/name, org/name@revision, "
            "org/name:QUANT or org/name/file.gguf)",
            file=sys.stderr,
        )
        return 2
    files: dict[str, tuple[int, int]] = {}
    said: list[str] = []
    with growing_bar(f"pulling {ref}") as show:

        def report(progress: hub.Progress) -> None:
            if progress.file:
                files[progress.file] = (progress.completed, progress.total)
                show(sum(done for done, _ in files.values()), sum(total for _, total in files.values()))
            if not sys.stderr.isatty() and (not said or said[-1] != progress.status) and not progress.file:
                print(progress.status, file=sys.stderr, flush=True)
            said.append(progress.status)

        try:
            path = hub.pull(ref, report)
        except hub.HubError as error:
            print(f"supervisor pull: {error.message}", file=sys.stderr)
            return 1
    total = sum(total for _, total in files.values())
    print(f"{ref}: {total / 2**20:.1f} MiB in {path}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m supervisor", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    serve_parser = commands.add_parser("serve", help="run the supervisor")
    serve_parser.add_argument("--config", help="TOML file (default: serve the embedded default pair)")
    serve_parser.add_argument("--sample-request", action="store_true", help="answer one sample request once ready")
    for name in ("chat", "generate", "models", "memory", "status", "top"):
        sub = commands.add_parser(name)
        sub.add_argument("--address", default=DEFAULT_LISTEN)
        sub.add_argument("--token", default="", help="bearer token, when the supervisor requires one")
        if name == "chat":
            sub.add_argument("--model", default="")
            sub.add_argument("--system", default="", help="a system message that opens the conversation")
            sub.add_argument("--max-tokens", type=int, default=1024)
            sub.add_argument("--temperature", type=float, default=0.0)
        if name == "top":
            sub.add_argument("--once", action="store_true", help="print one frame and exit (for scripts)")
            sub.add_argument("--interval", type=float, default=2.0, help="seconds between frames")
        if name == "generate":
            sub.add_argument("--model", default="")
            sub.add_argument("--max-tokens", type=int, default=200)
            sub.add_argument("--temperature", type=float, default=0.0)
            sub.add_argument("--timeout", type=float, default=300)
            sub.add_argument("prompt")
    estimate_parser = commands.add_parser(
        "estimate", help="print the memory a config's models need (for a pod's memory request or MemoryMax)"
    )
    estimate_parser.add_argument("--config", help="TOML file (default: the embedded default pair)")
    estimate_parser.add_argument(
        "model", nargs="?", help="a hub repository (org/name...) instead of a config: its estimate, before a pull"
    )
    pull_parser = commands.add_parser("pull", help="fetch a model from the Hugging Face hub into the hub cache")
    pull_parser.add_argument("model", help="org/name, org/name@revision, org/name:QUANT or org/name/file.gguf")
    worker_parser = commands.add_parser(
        "worker", help="run this host's rank of a model's group across hosts (the model's ranks and hostfile)"
    )
    worker_parser.add_argument("--config", help="TOML file: the leader's")
    worker_parser.add_argument("--model", required=True, help="the model whose group this host joins")
    worker_parser.add_argument("--rank", type=int, default=None, help="this host's rank (default: LWS_WORKER_INDEX)")
    hostfile_parser = commands.add_parser(
        "lws-hostfile", help="write a LeaderWorkerSet group's hostfile from the environment the set gives its pods"
    )
    hostfile_parser.add_argument("out", help="where to write it (the models' hostfile setting)")
    hostfile_parser.add_argument("--port", type=int, required=True, help="the port every rank listens on")
    args = parser.parse_args(argv)
    if args.command == "worker":
        from .worker import main as worker

        return worker(args)
    if args.command == "lws-hostfile":
        from .worker import write_lws_hostfile

        return write_lws_hostfile(args)
    if args.command == "serve":
        return serve(args)
    if args.command == "estimate":
        return estimate_command(args)
    if args.command == "pull":
        return pull_command(args)
    if args.command == "chat":
        from .chat import main as chat

        return chat(args)
    return client_command(args)


if __name__ == "__main__":
    sys.exit(main())
