"""Configuration, MPI attach and exit, and the launchers (cluster environment)."""
