"""Our XLA FFI custom calls: target names, attributes, backend_config, registration."""
