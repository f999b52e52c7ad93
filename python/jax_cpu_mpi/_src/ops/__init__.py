"""The psend/precv primitives (JAX's while JAX has them, ours after) and the public API."""
