"""The runner: one MLX model pair, speculative decoding, served over gRPC."""

__version__ = "0.1.0"
