"""jax_cpu_mpi's implementation, one subpackage per layer; dependencies point down this list:

``compat``    every private JAX / XLA / mpi4py name and version switch (a leaf)
``ffi``       our custom calls: names, attributes, backend_config, registration
``runtime``   configuration, MPI attach and exit, the launchers' cluster environment
``ops``       the psend/precv primitives (JAX's or ours) and the public functions
``lowering``  CPU lowerings, routing tables, optimization barriers over tokens
``parity``    XLA GPU's send/recv verifier, rebuilt (its rule and its order)
``dispatch``  jit's C++ path for psend/precv programs and the device-thread hint
``passes``    the one hook that runs the module passes after JAX lowers a program
``batching``  batching rules JAX lacks (psend/precv, reduced/unreduced collectives)
``pipeline``  pipeline schedules (GPipe, 1F1B, interleaved, ZB-H1) run on psend/precv (uses ``ops``)
``cli``       ``python -m jax_cpu_mpi`` (info, bench)
``install``   switches every feature on, in order (what ``import jax_cpu_mpi`` runs)

Nothing here is public API: :mod:`jax_cpu_mpi` re-exports what is.
"""

__version__ = "0.1.0"
