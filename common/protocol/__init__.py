"""Generated gRPC stubs for the runner service (proto/runner.proto). Do not edit."""
