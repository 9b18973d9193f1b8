"""The documentation against the code: docs/usage.md's option table against
the options the code declares and the defaults it applies, the pages' length
limits, and every local link of README.md and docs/ (outside docs/history/)."""

import contextlib
import io
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
USAGE = (ROOT / "docs/usage.md").read_text()
TABLE = re.search(
    r"<!-- options: .*? -->\n(.*?)<!-- end of options -->", USAGE, re.S
).group(1)


def rows() -> dict[str, list[str]]:
    """The option table's rows by option name: (where, default, effect)."""
    found = {}
    for line in TABLE.splitlines()[2:]:
        cells = [cell.strip() for cell in line.strip("|").split(" | ")]
        assert len(cells) == 4, line
        name = cells[0].strip("`")
        assert name not in found, f"{name} listed twice"
        found[name] = cells[1:]
    return found


def test_the_option_table_is_what_vllm_d3_options_prints():
    from vllm_d3.cli import main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["options"]) == 0
    assert printed.getvalue() == TABLE


def test_every_declared_option_is_in_the_table_once_and_no_other():
    from vllm_d3.options import OPTIONS

    assert list(rows()) == [option.name for option in OPTIONS]
    assert len({option.name for option in OPTIONS}) == len(OPTIONS)


def documented_default(name: str):
    """An option's default as docs/usage.md writes it, read back as a value."""
    default = rows()[name][1]
    return None if default == "none" else json.loads(default.strip("`"))


def test_the_documented_defaults_are_what_the_code_applies(monkeypatch):
    from vllm_d3.entrypoints.serve.middleware.systemone_body import max_body_bytes
    from vllm_d3.model_executor.models import d3_contract as contract
    from vllm_d3.v1.attention.backends.d3_dense_kernels import KERNEL_NAMES

    assert documented_default("d3_state_once") is contract.state_once_of({})
    assert documented_default("d3_attention_kernel") == contract.attention_kernel_of(
        {}, KERNEL_NAMES
    )
    assert documented_default(
        "d3_state_cache_min_tokens"
    ) == contract.state_cache_min_tokens_of({})
    monkeypatch.delenv("VLLM_D3_MAX_BODY_BYTES", raising=False)
    assert documented_default("VLLM_D3_MAX_BODY_BYTES") == max_body_bytes()
    # No default: a prefix_bidir request without a state size is refused, and
    # a prompt without question ends is one question.
    assert documented_default("d3_state_tokens") is None
    with pytest.raises(ValueError, match="needs the state block size"):
        contract.state_tokens_of({}, 10)
    assert documented_default("d3_question_ends") is None
    assert contract.question_ends_of({}, 10, 4) == [10]


def test_the_documented_keys_are_the_ones_the_code_reads():
    from vllm_d3.entrypoints.serve.middleware.systemone_body import (
        MAX_BODY_BYTES_ENV,
    )
    from vllm_d3.model_executor.models import d3_contract as contract

    where = {name: cells[0] for name, cells in rows().items()}
    for key in (
        contract.ATTENTION_KERNEL_KEY,
        contract.STATE_ONCE_KEY,
        contract.STATE_CACHE_MIN_TOKENS_KEY,
    ):
        assert where[key] == "--additional-config"
    assert where[contract.STATE_TOKENS_KEY] == "request field"
    assert where[contract.QUESTION_ENDS_KEY] == "request field"
    assert where[MAX_BODY_BYTES_ENV] == "environment"


@pytest.mark.parametrize(
    ("page", "most"), [("README.md", 150), ("docs/performance.md", 250)]
)
def test_a_page_stays_within_its_length(page, most):
    assert len((ROOT / page).read_text().splitlines()) <= most


PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PAGES += [ROOT / "docs/benchmarks/README.md"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_local_link_resolves(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    missing = [
        target
        for target in targets
        if "://" not in target and not (page.parent / target).exists()
    ]
    assert missing == []
