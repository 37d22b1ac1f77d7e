"""How the code is laid out, where a user would notice: the supervisor process never loads MLX."""

import json
import subprocess
import sys

from tests.processes import REPO, child_environment

IMPORT_EVERY_SUPERVISOR_MODULE = """
import importlib, json, pkgutil, sys
import supervisor, supervisor.protocol
for package in (supervisor, supervisor.protocol):
    for module in pkgutil.iter_modules(package.__path__):
        if module.name != "__main__":
            importlib.import_module(f"{package.__name__}.{module.name}")
import supervisor.__main__
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("mlx", "mlx_lm"))))
"""


def test_no_supervisor_module_imports_mlx():
    done = subprocess.run([sys.executable, "-c", IMPORT_EVERY_SUPERVISOR_MODULE], capture_output=True, text=True,
                          timeout=60, env=child_environment(), cwd=REPO, check=True)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
