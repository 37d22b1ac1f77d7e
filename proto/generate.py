"""Generate the Python gRPC stubs from the .proto files in this folder.

    python proto/generate.py [OUTPUT_ROOT]

Each ``NAME.proto`` is compiled as if it lived in the package that uses it
(``common.protocol`` or ``supervisor.protocol``), so the generated modules
import each other as ``from common.protocol import ...`` and never as a
top-level ``proto`` package.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PACKAGES = {"runner.proto": "common/protocol", "supervisor.proto": "supervisor/protocol"}


def generate(output_root: Path) -> list[Path]:
    from grpc_tools import protoc

    well_known = Path(protoc.__file__).parent / "_proto"
    written = []
    for proto, package_dir in PACKAGES.items():
        if not (HERE / proto).exists():
            continue
        (output_root / package_dir).mkdir(parents=True, exist_ok=True)
        args = [
            "protoc",
            *(f"-I{other}={HERE}" for other in PACKAGES.values()),
            f"-I{well_known}",
            f"--python_out={output_root}",
            f"--pyi_out={output_root}",
            f"--grpc_python_out={output_root}",
            f"{package_dir}/{proto}",
        ]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {proto}")
        stem = proto.removesuffix(".proto")
        written += [output_root / package_dir / f"{stem}{suffix}" for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]
    return written


if __name__ == "__main__":
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE.parent
    for path in generate(root):
        print(path)
