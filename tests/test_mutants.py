"""The mutants that once survived, each against the test that kills it now.

A case changes one function for the test (its source with one text replaced,
compiled in its own module's globals) and runs the rule test named: it must
pass on the code as written and fail on the mutant, so a rule test that is
removed or stops asserting its rule fails here. The full mutation run is
``python -m vllm_d3.testing.mutation`` (docs/mutation.json).
"""

import importlib
import inspect
import textwrap
from collections.abc import Callable
from typing import Any

import pytest

from vllm_d3.entrypoints.openai.decisions import d3_state_key
from vllm_d3.model_executor.models import d3_contract


def mutate(monkeypatch, function: Callable[..., Any], old: str, new: str) -> None:
    """``function`` with ``old`` (once in its source) replaced by ``new`` until
    the test ends."""
    source = textwrap.dedent(inspect.getsource(function))
    assert source.count(old) == 1, f"{old!r} is not once in {function.__name__}"
    namespace = dict(function.__globals__)
    code = compile(source.replace(old, new), inspect.getfile(function), "exec")
    exec(code, namespace)
    monkeypatch.setattr(function, "__code__", namespace[function.__name__].__code__)


#: (function, its text, the mutant's, the test module and test, its arguments)
MUTANTS = [
    pytest.param(
        d3_contract.question_ends_of,
        "a >= b",
        "a > b",
        "test_contract",
        "test_a_question_block_is_never_empty",
        {"ends": [7, 7, 12]},
        id="an empty question block",
    ),
    pytest.param(
        d3_contract.validated_length_of,
        "value <= 0",
        "value <= 1",
        "test_contract",
        "test_validated_length",
        {},
        id="a validated length of 1 refused",
    ),
    pytest.param(
        d3_contract.apply_validated_length,
        "given = model_config.original_max_model_len",
        "given = None",
        "test_contract",
        "test_validated_length_becomes_max_model_len",
        {"given": 1000, "derived": 1000, "validated": 512, "expected": 1000},
        id="the user's max_model_len overridden",
    ),
    pytest.param(
        d3_state_key.media_identifiers,
        'engine_input.get("mm_hashes")',
        "engine_input.get(None)",
        "test_state_cache",
        "test_the_keys_media_are_in_prompt_order",
        {},
        id="the media left out of the key",
    ),
    pytest.param(
        d3_state_key.media_identifiers,
        "strict=True",
        "strict=False",
        "test_state_cache",
        "test_the_keys_media_are_in_prompt_order",
        {},
        id="a hash without its placeholder left out of the key",
    ),
]


@pytest.mark.parametrize(
    ("function", "old", "new", "test_module", "test_name", "arguments"), MUTANTS
)
def test_a_mutant_that_once_survived_is_killed(
    monkeypatch, function, old, new, test_module, test_name, arguments
):
    rule_test = getattr(importlib.import_module(test_module), test_name)
    rule_test(**arguments)  # the control: the code as written passes
    mutate(monkeypatch, function, old, new)
    with pytest.raises((Exception, pytest.fail.Exception)):
        rule_test(**arguments)
