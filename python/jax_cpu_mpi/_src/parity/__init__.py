"""The GPU-parity check: XLA GPU's send/recv verifier (its rule, its order) on CPU programs."""
