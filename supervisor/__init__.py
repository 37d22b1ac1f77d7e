"""The supervisor: one runner child process per model, watched, restarted and served over gRPC."""
