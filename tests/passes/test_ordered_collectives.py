"""The collectives' ordering pass (passes/ordered_collectives.py) on a hand-written module:
calls of functions that hold collectives are inlined (nested calls, a callee called twice),
and the chain goes through a loop and a conditional. No MPI: the pass only rewrites text."""

from __future__ import annotations

import re

import pytest

from jax_cpu_mpi._src.compat import ir, make_ir_context
from jax_cpu_mpi._src.passes import ordered_collectives
from jax_cpu_mpi._src.runtime import config

_CALL = ('stablehlo.custom_call @jax_cpu_mpi_all_reduce(%{x}, %{p}) {{has_side_effect = true, '
         'mhlo.backend_config = {{site = 0 : i64}}, operand_layouts = [dense<0> : '
         'tensor<1xindex>, dense<> : tensor<0xindex>], result_layouts = [dense<0> : '
         'tensor<1xindex>]}} : (tensor<4xf32>, tensor<ui32>) -> tensor<4xf32>')


def _psum(out: str, x: str) -> str:
    return f"%p{out} = stablehlo.partition_id : tensor<ui32>\n    %{out} = " + _CALL.format(
        x=x, p=f"p{out}")


MODULE = f"""
module @m {{
  func.func public @main(%a: tensor<4xf32>, %i: tensor<i32>, %b: tensor<i1>) -> tensor<4xf32> {{
    {_psum("c0", "a")}
    %c1 = func.call @outer(%a) : (tensor<4xf32>) -> tensor<4xf32>
    %c2 = func.call @inner(%a) : (tensor<4xf32>) -> tensor<4xf32>
    %w:2 = stablehlo.while(%k = %i, %v = %a) : tensor<i32>, tensor<4xf32>
    cond {{
      {_psum("t0", "v")}
      %t = stablehlo.compare LT, %k, %k, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
      stablehlo.return %t : tensor<i1>
    }} do {{
      {_psum("l0", "v")}
      stablehlo.return %k, %l0 : tensor<i32>, tensor<4xf32>
    }}
    %f = "stablehlo.if"(%b) ({{
      {_psum("f0", "a")}
      stablehlo.return %f0 : tensor<4xf32>
    }}, {{
      stablehlo.return %a : tensor<4xf32>
    }}) : (tensor<i1>) -> tensor<4xf32>
    {_psum("c3", "a")}
    %s0 = stablehlo.add %c0, %c1 : tensor<4xf32>
    %s1 = stablehlo.add %s0, %c2 : tensor<4xf32>
    %s2 = stablehlo.add %s1, %w#1 : tensor<4xf32>
    %s3 = stablehlo.add %s2, %f : tensor<4xf32>
    %s4 = stablehlo.add %s3, %c3 : tensor<4xf32>
    return %s4 : tensor<4xf32>
  }}
  func.func private @outer(%x: tensor<4xf32>) -> tensor<4xf32> {{
    %y = func.call @inner(%x) : (tensor<4xf32>) -> tensor<4xf32>
    return %y : tensor<4xf32>
  }}
  func.func private @inner(%x: tensor<4xf32>) -> tensor<4xf32> {{
    {_psum("y", "x")}
    return %y : tensor<4xf32>
  }}
  func.func private @unrelated(%x: tensor<4xf32>) -> tensor<4xf32> {{
    return %x : tensor<4xf32>
  }}
}}
"""


@pytest.fixture(autouse=True)
def _calls_as_written():
    # The modules' psums would merge (passes/combined_all_reduces.py, tested on its own):
    # the chain is checked on the calls as written.
    with config.overrides(combine_bytes=0):
        yield


def _ordered() -> str:
    module = ir.Module.parse(MODULE, context=make_ir_context())
    chained = ordered_collectives.order_collectives(module)
    module.operation.verify()
    assert chained == 6  # every psum but the first reads the one before
    return str(module)


def test_calls_holding_collectives_are_inlined_and_their_functions_erased():
    text = _ordered()
    assert "func.call" not in text
    assert "@outer" not in text and "@inner" not in text
    assert "@unrelated" in text  # no collective: left alone
    sites = re.findall(r"site = (\d+)", text)
    assert sorted(map(int, sites)) == list(range(7))  # the callee called twice: two sites


def test_the_chain_goes_through_the_loop_and_the_conditional():
    text = _ordered()
    calls = re.findall(r"(%\w+) = stablehlo.custom_call @jax_cpu_mpi_all_reduce\(([^)]*)\)",
                       text)
    operands = [args.split(", ") for _, args in calls]
    # main's psum, the two inlined ones, the loop test's and body's, the conditional's, the
    # last.
    assert [len(o) for o in operands] == [2, 3, 3, 3, 3, 3, 3]
    # The loop carries the last psum before it, passed through; the psum of its test reads it
    # in the test's region, its body's in the body's (the pretty form names both alike).
    loop_result, loop_args = re.search(r"(%\w+):4 = stablehlo.while\(([^)]*)\)", text).groups()
    carried, init = loop_args.split(", ")[2].split(" = ")
    assert init == calls[2][0]
    assert operands[3][2] == carried and operands[4][2] == carried
    # And it carries out a token, 0 before the loop, that an order-token call sets from the
    # body's psum (a value XLA can neither fold nor trace back to before the loop).
    _, token_init = loop_args.split(", ")[3].split(" = ")
    assert re.search(rf"{token_init} = stablehlo.constant dense<0> : tensor<i32>", text)
    set_token = re.search(rf"(%\w+) = stablehlo.custom_call @jax_cpu_mpi_order_token\("
                          rf"{calls[4][0]}\)", text).group(1)
    assert re.search(rf"stablehlo.return %\w+, %\w+, {carried}, {set_token} :", text)
    # The conditional's psum reads the loop's token from above; the conditional gives out a
    # token of its own (its branch's psum's, 0 from the branch without one), which the last
    # psum reads.
    assert operands[5][2] == f"{loop_result}#3"
    cond_result = re.search(r'(%\w+):2 = "stablehlo.if"', text).group(1)
    assert operands[6][2] == f"{cond_result}#1"
    branches = text[text.index('"stablehlo.if"'):text.index(f"{calls[6][0]} = ")]
    assert re.search(rf"(%\w+) = stablehlo.custom_call @jax_cpu_mpi_order_token\("
                     rf"{calls[5][0]}\)", branches)
    assert re.search(r"stablehlo.return %\w+, %\w+ : tensor<4xf32>, tensor<i32>", branches)
    assert "stablehlo.constant dense<0> : tensor<i32>" in branches


def _local_psum(out: str, x: str, type_: str) -> str:
    call = _CALL.replace("tensor<4xf32>", type_)
    return f"%p{out} = stablehlo.partition_id : tensor<ui32>\n      %{out} = " + call.format(
        x=x, p=f"p{out}")


def _shard_map(name: str, operand: str, body: str) -> str:
    return (f'%{name} = sdy.manual_computation(%{operand}) in_shardings=[<@mesh, [{{"x"}}]>] '
            f'out_shardings=[<@mesh, [{{"x"}}]>] manual_axes={{"x"}} '
            f"(%x: tensor<2xf32>) {{\n      {body}\n    }} : (tensor<4xf32>) -> tensor<4xf32>")


# Two sibling shard_maps (sdy.manual_computation: their bodies read nothing from outside),
# the first before any other psum, the second after it, then a psum of main after both.
_NL = "\n      "
_FIRST = _local_psum("y", "x", "tensor<2xf32>") + _NL + "sdy.return %y : tensor<2xf32>"
_SECOND = _NL.join([_local_psum("y", "x", "tensor<2xf32>"), _local_psum("z", "y", "tensor<2xf32>"),
                    "sdy.return %z : tensor<2xf32>"])
SIBLINGS = f"""
module @m {{
  sdy.mesh @mesh = <["x"=2]>
  func.func public @main(%a: tensor<4xf32>) -> tensor<4xf32> {{
    {_shard_map("m0", "a", _FIRST)}
    {_shard_map("m1", "a", _SECOND)}
    {_psum("c", "m1")}
    %s = stablehlo.add %m0, %c : tensor<4xf32>
    return %s : tensor<4xf32>
  }}
}}
"""


def test_the_chain_goes_through_sibling_shard_maps():
    module = ir.Module.parse(SIBLINGS, context=make_ir_context())
    assert ordered_collectives.order_collectives(module) == 3
    module.operation.verify()
    text = str(module)
    first, second = re.findall(r"(%\w+):2 = sdy.manual_computation\(([^)]*)\) in_shardings="
                               r"\[([^\]]*\]>(?:, <[^>]*>)*)\] out_shardings=\[(.*)\] manual",
                               text)
    # The first gets no operand (nothing before it), one more result: its psum's, replicated
    # (each device keeps its own value, of the local type).
    assert first[1] == "%arg0"
    assert first[3].endswith(", <@mesh, [{}]>")
    # The second reads that result, replicated, and gives out its own last psum's.
    assert second[1] == f"%arg0, {first[0]}#1"
    assert second[2].endswith(", <@mesh, [{}]>") and second[3].endswith(", <@mesh, [{}]>")
    assert re.search(r"\(%arg1: tensor<2xf32>, (%arg2): tensor<2xf32>\)", text)
    calls = re.findall(r"(%\w+) = stablehlo.custom_call @jax_cpu_mpi_all_reduce\(([^)]*)\)",
                       text)
    operands = [args.split(", ") for _, args in calls]
    assert [len(o) for o in operands] == [2, 3, 3, 3]
    # Inside the second, its first psum reads the block argument of the link; its second
    # psum reads the first; main's last psum reads the second's link result.
    assert operands[1][2] == "%arg2" and operands[2][2] == calls[1][0]
    assert operands[3][2] == f"{second[0]}#1"
    assert re.search(rf"sdy.return {calls[2][0]}, {calls[2][0]} :", text)
    assert sorted(map(int, re.findall(r"site = (\d+)", text))) == [0, 1, 2, 3]


_END = r"stablehlo.custom_call @jax_cpu_mpi_collectives_end\(([^)]*)\)"


def test_the_chain_ends_in_a_call_after_the_last_collective_and_what_is_returned():
    # The last psum is main's own (no SPMD partitioning): the end goes before main's return
    # and reads that psum's result and main's returned value.
    text = _ordered()
    ends = re.findall(_END, text)
    assert len(ends) == 1
    calls = re.findall(r"(%\w+) = stablehlo.custom_call @jax_cpu_mpi_all_reduce", text)
    returned = re.search(r"return (%\w+) : tensor<4xf32>\n  }\n  func.func private @unrel",
                         text).group(1)
    assert ends[0].split(", ") == [calls[-1], returned]
    assert text.index("collectives_end") > text.index(f"{calls[-1]} = stablehlo.custom_call")
    assert "has_side_effect = true" in text[text.index("collectives_end"):]


def _partitioned(body: str) -> str:
    return f"""
module @m attributes {{mhlo.num_partitions = 2 : i32}} {{
  sdy.mesh @mesh = <["x"=2]>
  func.func public @main(%a: tensor<4xf32>, %i: tensor<i32>) -> tensor<4xf32> {{
    {body}
  }}
}}
"""


def test_a_chain_that_ends_in_a_shard_map_ends_inside_it():
    # SPMD wants a sharding on a side-effecting call outside a manual computation: the end
    # goes inside the shard_map, after its last psum, reading what its body returns.
    module = ir.Module.parse(_partitioned(
        _shard_map("m0", "a", _SECOND) + "\n    return %m0 : tensor<4xf32>"),
        context=make_ir_context())
    ordered_collectives.order_collectives(module)
    module.operation.verify()
    text = str(module)
    calls = re.findall(r"(%\w+) = stablehlo.custom_call @jax_cpu_mpi_all_reduce", text)
    ends = re.findall(_END, text)
    assert ends == [calls[-1]]  # the body returns that psum's result itself
    end = text.index("collectives_end")
    assert text.index("sdy.manual_computation") < end < text.index("sdy.return")


def test_a_chain_that_ends_in_a_loop_outside_a_shard_map_has_no_end():
    # Nowhere to put it without a sharding: parked devices resume a little later instead.
    loop = f"""%w:2 = stablehlo.while(%k = %i, %v = %a) : tensor<i32>, tensor<4xf32>
    cond {{
      %t = stablehlo.compare LT, %k, %k, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
      stablehlo.return %t : tensor<i1>
    }} do {{
      {_psum("l0", "v")}
      stablehlo.return %k, %l0 : tensor<i32>, tensor<4xf32>
    }}
    return %w#1 : tensor<4xf32>"""
    module = ir.Module.parse(_partitioned(loop), context=make_ir_context())
    ordered_collectives.order_collectives(module)
    module.operation.verify()
    assert "collectives_end" not in str(module)
