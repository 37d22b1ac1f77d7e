"""Generate once in-process with the default pair and print the text and stats."""

import argparse
import sys

from .cpu_blas import reexec_with_fast_blas
from .defaults import DEFAULT_DRAFT, DEFAULT_TARGET


def main() -> None:
    reexec_with_fast_blas()
    from .engine import Engine, GenerationRequest

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("prompt", nargs="?", default="The for statement")
    parser.add_argument("--max-tokens", type=int, default=200)
    args = parser.parse_args()
    engine = Engine.load(DEFAULT_TARGET, DEFAULT_DRAFT)
    for round_ in engine.generate(GenerationRequest(prompt=args.prompt, max_tokens=args.max_tokens)):
        sys.stdout.write(round_.text)
        sys.stdout.flush()
    s = round_.stats
    print(f"\n\n[{round_.finish_reason}] {s.generated_tokens} tokens, {s.tokens_per_second:.0f} tok/s, "
          f"acceptance {s.acceptance_rate:.2f}, releases at {s.release_positions}")


if __name__ == "__main__":
    main()
