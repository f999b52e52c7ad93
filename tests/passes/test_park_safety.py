"""Which programs may park their devices in our collectives' meetings (passes/park_safety.py),
on hand-written modules, and the ``park`` attribute the ordering pass gives their calls.
No MPI: the pass only reads and rewrites text."""

from __future__ import annotations

import re

import pytest

from jax_cpu_mpi._src.compat import ir, make_ir_context
from jax_cpu_mpi._src.passes import ordered_collectives, park_safety

_PSUM = ('%p{out} = stablehlo.partition_id : tensor<ui32>\n      %{out} = stablehlo.custom_call '
         '@jax_cpu_mpi_all_reduce(%{x}, %p{out}) {{has_side_effect = true, mhlo.backend_config '
         '= {{park = 0 : i64, site = 0 : i64}}, operand_layouts = [dense<0> : tensor<1xindex>, '
         'dense<> : tensor<0xindex>], result_layouts = [dense<0> : tensor<1xindex>]}} : '
         '(tensor<2xf32>, tensor<ui32>) -> tensor<2xf32>')


def _module(body: str, *, outside: str = "", arg: str = '[{"x"}]', result: str = '[{"x"}]',
            in_sharding: str = '[{"x"}]', manual: str = '{"x"}',
            mesh: str = '["x"=2]', returned: str = "%m") -> str:
    """A partitioned program: main runs one shard_map (its body ``body`` after a psum of its
    operand into %y, returning %z), then ``outside``, and returns ``returned``."""
    return f"""
module @m attributes {{mhlo.num_partitions = 2 : i32}} {{
  sdy.mesh @mesh = <{mesh}>
  func.func public @main(%a: tensor<4xf32> {{sdy.sharding = #sdy.sharding<@mesh, {arg}>}})
      -> (tensor<4xf32> {{sdy.sharding = #sdy.sharding<@mesh, {result}>}}) {{
    %m = sdy.manual_computation(%a) in_shardings=[<@mesh, {in_sharding}>]
        out_shardings=[<@mesh, [{{"x"}}]>] manual_axes={manual} (%x: tensor<2xf32>) {{
      {_PSUM.format(out="y", x="x")}
      {body}
      sdy.return %z : tensor<2xf32>
    }} : (tensor<4xf32>) -> tensor<4xf32>
    {outside}
    return {returned} : tensor<4xf32>
  }}
}}
"""


def _parse(text: str):
    return ir.Module.parse(text, context=make_ir_context())


_MUL = "%z = stablehlo.multiply %y, %y : tensor<2xf32>"
_TWO_PSUMS = _PSUM.format(out="z", x="y")
_PSEND = ('%z = stablehlo.custom_call @jax_cpu_mpi_precv(%y) {has_side_effect = true} : '
          "(tensor<2xf32>) -> tensor<2xf32>")
_XLA_PERMUTE = ('%z = "stablehlo.collective_permute"(%y) {source_target_pairs = '
                "dense<[[0, 1], [1, 0]]> : tensor<2x2xi64>, channel_handle = "
                "#stablehlo.channel_handle<handle = 1, type = 1>} : "
                "(tensor<2xf32>) -> tensor<2xf32>")
_CALLBACK = ('%z = stablehlo.custom_call @xla_ffi_python_cpu_callback(%y) '
             "{has_side_effect = true} : (tensor<2xf32>) -> tensor<2xf32>")
_TOKEN = ("%tok = stablehlo.custom_call @jax_cpu_mpi_order_token(%y) : "
          "(tensor<2xf32>) -> tensor<i32>\n      " + _MUL)
_LAPACK = ("%z = stablehlo.custom_call @lapack_sgetrf_ffi(%y) : "
           "(tensor<2xf32>) -> tensor<2xf32>")
_OUTFEED = ("%t = stablehlo.create_token : !stablehlo.token\n"
            '      %o = "stablehlo.outfeed"(%y, %t) : (tensor<2xf32>, !stablehlo.token) -> '
            "!stablehlo.token\n      " + _MUL)


@pytest.mark.parametrize(("body", "parks"), [
    (_MUL, True),
    (_TWO_PSUMS, True),
    (_LAPACK, True),
    (_TOKEN, True),  # the ordering pass's token after a loop or conditional
    (_PSEND, False),  # our precv: waits for another device's psend
    (_XLA_PERMUTE, False),  # XLA's own collective
    (_CALLBACK, False),  # a host callback: Python code that may wait on anything
    (_OUTFEED, False),
])
def test_only_programs_whose_steps_cannot_wait_for_another_device_park(body, parks):
    assert park_safety.may_park(_parse(_module(body))) is parks


@pytest.mark.parametrize(("kwargs", "why"), [
    ({"outside": "%s = stablehlo.multiply %m, %m : tensor<4xf32>", "returned": "%s"},
     "a computation outside the shard_map (the partitioner may reshard it)"),
    ({"result": "[{}]"}, "the result replicated, the shard_map's sharded: an all-gather"),
    ({"arg": "[{}]"}, "the operand replicated, the shard_map wants it sharded"),
    ({"mesh": '["x"=2, "y"=2]'}, "manual over x only: XLA partitions the body over y"),
    ({"outside": '%s = sdy.sharding_constraint %m <@mesh, [{}]> : tensor<4xf32>',
      "returned": "%s", "result": "[{}]"}, "a sharding constraint that replicates"),
])
def test_a_partitioned_program_that_xla_may_reshard_does_not_park(kwargs, why):
    assert not park_safety.may_park(_parse(_module(_MUL, **kwargs))), why


def test_a_sharding_constraint_that_keeps_the_sharding_parks():
    # jax 0.12 puts one on each shard_map result.
    assert park_safety.may_park(_parse(_module(
        _MUL, outside='%s = sdy.sharding_constraint %m <@mesh, [{"x"}]> : tensor<4xf32>',
        returned="%s")))


def test_a_mesh_axis_of_size_one_need_not_be_manual():
    assert park_safety.may_park(_parse(_module(_MUL, mesh='["x"=2, "y"=1]')))


def test_the_ordering_pass_marks_the_calls_of_a_parkable_program_only():
    for body, parks in ((_TWO_PSUMS, 1), (_TWO_PSUMS + "\n      " + _CALLBACK.replace(
            "%z = ", "%cb = ").replace("(%y)", "(%z)"), 0)):
        module = _parse(_module(body))
        ordered_collectives.order_collectives(module)
        module.operation.verify()
        assert re.findall(r"park = (\d)", str(module)) == [str(parks)] * 2
        # The chain's end (which resumes parked devices) only where they may park: in the
        # other program it would order its end and put one more target of ours in an export.
        assert str(module).count("jax_cpu_mpi_collectives_end") == parks
