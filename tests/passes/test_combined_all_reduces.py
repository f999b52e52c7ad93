"""The all-reduce merging pass (passes/combined_all_reduces.py) on hand-written modules:
which calls merge into one, which stay calls of their own, and that the rewritten module
verifies. No MPI: the pass only rewrites text (tests/mpi_programs/collectives_cases.py runs
merged calls against separate ones and gloo)."""

from __future__ import annotations

import re

import pytest

from jax_cpu_mpi._src.compat import ir, make_ir_context
from jax_cpu_mpi._src.passes import combined_all_reduces
from jax_cpu_mpi._src.runtime import config


def _call(out: str, x: str, shape: str, *, reduction: str = "sum", groups: str = "0, 1") -> str:
    return (f'%p{out} = stablehlo.partition_id : tensor<ui32>\n    %{out} = stablehlo.custom_call '
            f'@jax_cpu_mpi_all_reduce(%{x}, %p{out}) {{has_side_effect = true, '
            f'mhlo.backend_config = {{groups = dense<[{groups}]> : tensor<2xi64>, '
            f'op = "psum(axes=(\'x\',))", operand = "float32[{shape}]", '
            f'reduction = "{reduction}", site = 0 : i64}}, operand_layouts = [dense<0> : '
            f'tensor<1xindex>, dense<> : tensor<0xindex>], result_layouts = [dense<0> : '
            f'tensor<1xindex>]}} : (tensor<{shape}xf32>, tensor<ui32>) -> tensor<{shape}xf32>')


def _run(body: str, args: str, results: str, returned: str, **overrides) -> tuple[int, str]:
    text = f"""
module @m {{
  func.func public @main({args}) -> ({results}) {{
    {body}
    return {returned} : {results}
  }}
}}
"""
    module = ir.Module.parse(text, context=make_ir_context())
    with config.overrides(**overrides):
        merged = combined_all_reduces.combine_all_reduces(module)
    module.operation.verify()
    return merged, str(module)


def _calls(text: str) -> list[str]:
    return re.findall(r"custom_call @jax_cpu_mpi_all_reduce\((.*)", text)


def test_independent_leaves_merge_and_their_results_are_sliced_back():
    merged, text = _run(
        "\n    ".join([_call("r0", "a", "4"), _call("r1", "b", "6"), _call("r2", "c", "2")]),
        "%a: tensor<4xf32>, %b: tensor<6xf32>, %c: tensor<2xf32>",
        "tensor<4xf32>, tensor<6xf32>, tensor<2xf32>", "%r0, %r1, %r2")
    assert merged == 2
    (call,) = _calls(text)
    assert "(tensor<12xf32>, tensor<ui32>) -> tensor<12xf32>" in call
    assert "3 combined" in call and "float32[12] (float32[4], float32[6], float32[2])" in call
    assert "stablehlo.concatenate" in text
    for piece in ("[0:4]", "[4:10]", "[10:12]"):
        assert piece in text


@pytest.mark.parametrize("between", [
    # The second psum's operand is the first's result.
    "%t = stablehlo.add %r0, %r0 : tensor<4xf32>",
    # A loop reads the first result before the second psum (a use in a nested region).
    "%w:2 = stablehlo.while(%k = %i, %v = %b) : tensor<i32>, tensor<4xf32>\n"
    "    cond {\n      %c = stablehlo.compare LT, %k, %k, SIGNED : (tensor<i32>, tensor<i32>)"
    " -> tensor<i1>\n      stablehlo.return %c : tensor<i1>\n    } do {\n"
    "      %u = stablehlo.add %v, %r0 : tensor<4xf32>\n"
    "      stablehlo.return %k, %u : tensor<i32>, tensor<4xf32>\n    }\n"
    "    %t = stablehlo.add %w#1, %b : tensor<4xf32>",
])
def test_a_result_read_before_the_next_call_keeps_the_calls_apart(between):
    body = "\n    ".join([_call("r0", "a", "4"), between, _call("r1", "t", "4")])
    merged, text = _run(body, "%a: tensor<4xf32>, %b: tensor<4xf32>, %i: tensor<i32>",
                        "tensor<4xf32>, tensor<4xf32>", "%r0, %r1")
    assert merged == 0
    assert len(_calls(text)) == 2


def test_a_call_reading_the_run_s_result_starts_a_new_run():
    # r0 and r1 merge; r2 reads r0 (so it runs after the merged call), r3 merges with r2.
    body = "\n    ".join([_call("r0", "a", "4"), _call("r1", "b", "4"),
                          _call("r2", "r0", "4"), _call("r3", "b", "4")])
    merged, text = _run(body, "%a: tensor<4xf32>, %b: tensor<4xf32>",
                        "tensor<4xf32>, tensor<4xf32>, tensor<4xf32>, tensor<4xf32>",
                        "%r0, %r1, %r2, %r3")
    assert merged == 2
    assert len(_calls(text)) == 2


def test_other_reductions_groups_and_large_operands_stay_apart():
    body = "\n    ".join([
        _call("r0", "a", "4"), _call("r1", "a", "4", reduction="max"),
        _call("r2", "a", "4", groups="1, 0"), _call("r3", "big", "131072")])
    merged, text = _run(body, "%a: tensor<4xf32>, %big: tensor<131072xf32>",
                        "tensor<4xf32>, tensor<4xf32>, tensor<4xf32>, tensor<131072xf32>",
                        "%r0, %r1, %r2, %r3", combine_bytes=64 << 10)
    assert merged == 0
    assert len(_calls(text)) == 4


def test_merging_is_off_with_combine_bytes_zero():
    body = "\n    ".join([_call("r0", "a", "4"), _call("r1", "b", "4")])
    merged, text = _run(body, "%a: tensor<4xf32>, %b: tensor<4xf32>",
                        "tensor<4xf32>, tensor<4xf32>", "%r0, %r1", combine_bytes=0)
    assert merged == 0
    assert len(_calls(text)) == 2


def test_a_bool_takes_a_byte_against_the_limit():
    # XLA keeps a bool (i1) in a byte: 65536 bools are 64 KiB, over a 32 KiB limit, and
    # stay calls of their own (counted at a bit each they were 8 KiB and merged).
    def bools(out: str, x: str) -> str:
        return _call(out, x, "65536", reduction="max").replace("xf32", "xi1").replace(
            "float32", "bool")
    body = "\n    ".join([bools("r0", "a"), bools("r1", "b")])
    merged, text = _run(body, "%a: tensor<65536xi1>, %b: tensor<65536xi1>",
                        "tensor<65536xi1>, tensor<65536xi1>", "%r0, %r1",
                        combine_bytes=32 << 10)
    assert merged == 0
    assert len(_calls(text)) == 2
    # Below the limit they merge (the test reads bools at all).
    small = body.replace("65536", "16")
    merged, _ = _run(small, "%a: tensor<16xi1>, %b: tensor<16xi1>",
                     "tensor<16xi1>, tensor<16xi1>", "%r0, %r1", combine_bytes=32 << 10)
    assert merged == 1
