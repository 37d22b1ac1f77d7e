"""Generated gRPC stubs for the public service (proto/supervisor.proto). Do not edit."""
