"""The runner: one MLX model pair, speculative decoding, served over gRPC."""
