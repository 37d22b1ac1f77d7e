"""python -m bench [SECTION ...]: run the benchmarks and write docs/benchmarks.md.

Each section is one module of this package (``SECTIONS``); its ``run()`` prints
Markdown tables. They are shown as they come and, once a section has finished,
written into docs/benchmarks.md under that section's heading with the date and
the machine, replacing the section's previous tables. Sections not run this
time keep theirs, so the page always holds the latest run of each; earlier runs
stay in git history. ``--no-write`` only prints.
"""

import sys

from common.cpu_blas import reexec_with_fast_blas

SECTIONS = (
    "speculation",
    "depth",
    "mtp",
    "head",
    "block",
    "learned",
    "release_rule",
    "runner",
    "supervisor",
    "front_door",
    "scheduler",
    "real_model",
    "gguf_import",
    "prompt_cache",
    "kv_quant",
    "group",
    "batching",
    "grammar",
    "structured",
    "tools",
    "claude_code",
    "pull",
    "adapters",
    "reasoning",
    "vision",
    "versus",
    "embeddings",
)

PAGE_HEADER = """# Benchmarks

Written by `python -m bench` (`make bench`): each section below is the latest run of its module in `bench/`,
with the date and the machine it ran on; `python -m bench SECTION ...` reruns some sections and keeps the
others. Earlier runs are in the git history of this page. Ratios are within one run: the machines are
shared and absolute tok/s moves between runs, so compare ratios within a table, not numbers across tables.
What the figures mean for the design is in [design.md](design.md); figures from a GPU are in
[gpu.md](gpu.md).
"""


def begin_marker(name: str) -> str:
    return f"<!-- bench:{name} -->"


def end_marker(name: str) -> str:
    return f"<!-- /bench:{name} -->"


def machine() -> str:
    """One line: cores and CPU, memory, OS, MLX's version and device, and whether MKL serves the CPU's BLAS."""
    import os
    import platform
    from importlib import metadata

    cpu = platform.processor()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    parts = [f"{os.cpu_count()} cores ({cpu or 'unknown CPU'}, {platform.machine()})"]
    try:
        import psutil

        parts.append(f"{psutil.virtual_memory().total / 2**30:.0f} GiB")
    except ImportError:
        pass
    parts.append(platform.system())
    try:
        import mlx.core as mx

        from common import cpu_blas

        device = "the CPU" if mx.default_device() == mx.cpu else "the GPU"
        blas = " with MKL" if device == "the CPU" and cpu_blas.is_loaded() else ""
        parts.append(f"MLX {metadata.version('mlx')} on {device}{blas}")
    except Exception:  # the page still gets a machine line without MLX
        pass
    return ", ".join(parts)


def demote(text: str) -> str:
    """A module's own headings one level down, under its section's heading."""
    return "\n".join("#" + line if line.startswith("#") else line for line in text.splitlines())


def section_text(name: str, printed: str, date: str, where: str) -> str:
    return (
        f"{begin_marker(name)}\n## {name}\n\n`bench/{name}.py`, run on {date}: {where}.\n\n"
        f"{demote(printed).strip()}\n\n{end_marker(name)}\n"
    )


def read_sections(page: str) -> dict[str, str]:
    """The sections of an existing page, by name, each from its begin marker to its end marker."""
    sections = {}
    for name in SECTIONS:
        start, end = page.find(begin_marker(name)), page.find(end_marker(name))
        if start != -1 and end > start:
            sections[name] = page[start : end + len(end_marker(name))] + "\n"
    return sections


def write_page(path, sections: dict[str, str]) -> None:
    """The header, then every section in ``SECTIONS`` order; written beside the page and renamed into place."""
    body = "\n".join(sections[name] for name in SECTIONS if name in sections)
    partial = path.with_suffix(".md.partial")
    partial.write_text(f"{PAGE_HEADER}\n{body}")
    partial.replace(path)


class Tee:
    """Writes to the terminal and keeps a copy."""

    def __init__(self, stream):
        self.stream, self.parts = stream, []

    def write(self, text: str) -> int:
        self.parts.append(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def text(self) -> str:
        return "".join(self.parts)


def main() -> None:
    reexec_with_fast_blas()
    import contextlib
    import importlib
    import time
    from pathlib import Path

    args = sys.argv[1:]
    write = "--no-write" not in args
    wanted = [a for a in args if a != "--no-write"] or list(SECTIONS)
    unknown = [name for name in wanted if name not in SECTIONS]
    if unknown:
        sys.exit(f"python -m bench: unknown section {', '.join(unknown)} (one of {', '.join(SECTIONS)})")
    page = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
    where = machine()
    print(f"# mlxserve benchmarks, {time.strftime('%Y-%m-%d')}, {where}\n")
    for name in wanted:
        module = importlib.import_module(f"bench.{name}")
        tee = Tee(sys.stdout)
        with contextlib.redirect_stdout(tee):
            module.run()
        if write:  # after each section, so a long run cut short keeps what it finished
            sections = read_sections(page.read_text()) if page.is_file() else {}
            sections[name] = section_text(name, tee.text(), time.strftime("%Y-%m-%d"), where)
            write_page(page, sections)
            print(f"(wrote section {name} of {page})\n", flush=True)


if __name__ == "__main__":
    main()
