"""The flag checks the benches share: each error names the field, its unit and the value."""

import argparse

import pytest

from ringllm.tools.bench.flags import check_at_least, check_one_process, parse_names


def test_check_at_least_names_the_field_its_unit_and_the_value():
    args = argparse.Namespace(num_iters=0, output_len=1)
    check_at_least(args, (("num_iters", "rounds", 0), ("output_len", "tokens", 1)))
    with pytest.raises(ValueError, match=r"^num_iters: must be >= 1 rounds, got 0$"):
        check_at_least(args, (("num_iters", "rounds", 1),))
    with pytest.raises(ValueError, match=r"^output_len: must be >= 2, got 1$"):
        check_at_least(args, (("output_len", "", 2),))


def test_parse_names_keeps_the_order_and_refuses_unknown_or_empty_lists():
    assert parse_names("parts", " b, a ,", ("a", "b")) == ["b", "a"]
    for text in ("", " , ", "a,c"):
        with pytest.raises(ValueError, match="parts: .* must list some of a, b"):
            parse_names("parts", text, ("a", "b"))


def test_check_one_process_refuses_tp_or_dp_above_one():
    check_one_process(argparse.Namespace(tensor_parallel_size=None, data_parallel_size=1), "x")
    with pytest.raises(ValueError, match=r"^data_parallel_size: reads one core; run it with 1$"):
        check_one_process(argparse.Namespace(data_parallel_size=2), "reads one core")
