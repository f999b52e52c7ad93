"""The lowering hook: module passes run in one fixed order after JAX lowers a program."""
