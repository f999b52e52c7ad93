"""Pipeline-parallel schedules (GPipe, 1F1B, interleaved 1F1B, ZB-H1) on psend/precv.

``schedules``  the schedules as data: tables, validation, bubble and stash figures
``plan``       a schedule's table as the executor's static integer tables and message ops
``executor``   :func:`value_and_grad` inside ``shard_map``: one ``lax.scan`` over the ticks
``per_chunk``  chunks whose parameters differ in shape: flattened, padded, one function each
``sharded``    :func:`shard_value_and_grad`: the ``shard_map`` built for a mesh
``reference``  the same model on one device, and parameter / batch layout helpers
``nnx``        Flax NNX blocks as stacked stage parameters and a stage function, and back

Depends on ``ops`` (psend/precv) only; public as :mod:`jax_cpu_mpi.pipeline`.
"""
