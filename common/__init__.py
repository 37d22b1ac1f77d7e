"""What the runner and the supervisor share, importable without MLX.

The supervisor process never loads MLX: it imports this package and its own, never ``runner``
(tests/test_structure.py checks the imports of every module). Here: the defaults, the runner's settings
(``common.settings``), request validation (``common.validation``), the errors and their gRPC statuses,
the runner's gRPC contract and client, the memory footprint of a model folder, and the CPU BLAS preload.
"""

__version__ = "0.1.0"
