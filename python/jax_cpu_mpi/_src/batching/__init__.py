"""Batching rules JAX lacks: psend/precv and the reduced/unreduced collectives."""
