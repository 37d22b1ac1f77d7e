import sys

from common.cpu_blas import reexec_with_fast_blas

SECTIONS = ("speculation", "runner", "supervisor", "real_model", "gguf_import", "prompt_cache", "batching")


def main() -> None:
    reexec_with_fast_blas()
    import importlib
    import platform
    import time

    wanted = sys.argv[1:] or SECTIONS
    print(f"# mlxserve benchmarks, {time.strftime('%Y-%m-%d')}, {platform.machine()}, "
          f"{platform.processor() or platform.platform()}\n")
    for name in wanted:
        try:
            module = importlib.import_module(f"bench.{name}")
        except ModuleNotFoundError:
            continue
        module.run()


if __name__ == "__main__":
    main()
