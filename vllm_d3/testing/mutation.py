"""Mutation testing of the rules that decide answers, and its record.

``python -m vllm_d3.testing.mutation`` runs mutmut (``pip install -e
".[test,mutation]"``) once per module of ``MODULES``, in a work folder of its
own under ``mutants/``, with pyproject.toml's ``[tool.mutmut]`` settings and
that module's test files: each mutant runs against those of the tests that
call the function it changes. It then writes ``docs/mutation.json``: per
module the mutants killed, survived, equivalent and timed out, and each
survivor with its line, its change and why it survives (``EQUIVALENT``,
``NOT_KILLED``); a survivor with no reason there makes it exit 1.
``--report`` writes the record from the last run's results only;
``--survivors`` runs the last run's survivors again (after new tests), the
other results kept; naming modules runs only those.
"""

import argparse
import ast
import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib


@dataclass(frozen=True)
class Module:
    """A module under mutation: its test files, and the functions whose
    mutants run (mutmut's names: ``x_f`` for a function, ``xǁClassǁm`` for a
    method; empty: all)."""

    tests: tuple[str, ...]
    functions: tuple[str, ...] = ()
    #: mutmut's timeout_constant and timeout_multiplier, where its tests
    #: start no engine and a mutant that hangs a request need not wait long.
    timeout: tuple[float, float] | None = None


MODULES: dict[str, Module] = {
    "vllm_d3/model_executor/models/d3_contract.py": Module(("tests/test_contract.py",)),
    "vllm_d3/entrypoints/pooling/d3_state_tokens.py": Module(
        ("tests/test_entrypoints.py",)
    ),
    "vllm_d3/entrypoints/openai/decisions/d3_state_key.py": Module(
        ("tests/test_state_cache.py",)
    ),
    "vllm_d3/entrypoints/serve/middleware/systemone_body.py": Module(
        ("tests/test_systemone_body.py",), timeout=(2.0, 3.0)
    ),
    # Its planning rule: which questions go in which engine request.
    "vllm_d3/entrypoints/openai/decisions/d3_reads.py": Module(
        ("tests/test_strategy.py",), ("x_pack_questions",)
    ),
}

CONTRACT = "vllm_d3/model_executor/models/d3_contract.py"
#: Why ``zip(..., strict=False)`` with ``strict=None`` or without it is the same.
ZIP_DEFAULT = "zip is not strict by default, and None is as false as False"


def _zip_default(module: str, line: str, tail: str = "") -> dict[tuple[str, str], str]:
    """The two mutants of a ``strict=False`` zip in ``line`` (``tail``: the
    line that closes the call, where it is its own)."""
    none = line.replace("strict=False", "strict=None")
    if tail:
        dropped = line.replace("strict=False", "") + tail
        return {
            (module, f"{line} -> {none}"): ZIP_DEFAULT,
            (module, f"{line} {tail} -> {dropped}"): ZIP_DEFAULT,
        }
    dropped = line.replace("strict=False", "")
    return {
        (module, f"{line} -> {none}"): ZIP_DEFAULT,
        (module, f"{line} -> {dropped}"): ZIP_DEFAULT,
    }


STATE_KEY = "vllm_d3/entrypoints/openai/decisions/d3_state_key.py"
HEAD = 'digest = hashlib.sha256(json.dumps(head, separators=(",", ":")).encode())'
#: Why the state key's head may be written with other JSON separators.
SEPARATORS = (
    "the head is still JSON that reads back one way, so the key covers the same "
    "fields and tells the same states apart (keys live as long as the engine's "
    "prefix cache, not across restarts)"
)

BODY = "vllm_d3/entrypoints/serve/middleware/systemone_body.py"
MESSAGE = 'return {"type": "http.request", "body": body, "more_body": False}'
#: Why the replayed message may lose its ``more_body``.
MORE_BODY = "an ASGI http.request message without more_body has none: False"

#: Survivors that change nothing, by (module, mutation): why.
EQUIVALENT: dict[tuple[str, str], str] = {
    (BODY, "sent = False -> sent = None"): (
        "None is as false as False: the body is still sent once, first"
    ),
    **{
        (BODY, f"{MESSAGE} -> {MESSAGE.replace('more_body', key)}"): MORE_BODY
        for key in ("XXmore_bodyXX", "MORE_BODY")
    },
    (
        BODY,
        'image_format = image.format or "" -> image_format = image.format or "XXXX"',
    ): "an image PIL opened from bytes has its format: the fallback is never read",
    (
        BODY,
        'and scope["path"].removeprefix(scope.get("root_path", "")) == ROUTE -> '
        'and scope["path"].removeprefix(scope.get("root_path", "XXXX")) == ROUTE',
    ): 'no path starts with the other default: it removes nothing, as "" does',
    **{
        (BODY, f"{line} -> {line.replace(name, name.upper())}"): (
            "Starlette's headers are case-blind"
        )
        for name, line in [
            (
                "content-encoding",
                'encoding = headers.get("content-encoding", "").strip().lower() '
                "or IDENTITY",
            ),
            ("content-type", 'content_type = headers.get("content-type", "")'),
            ("content-encoding", 'del rewritten["content-encoding"]'),
            ("content-type", 'rewritten["content-type"] = content_type'),
            ("content-length", 'rewritten["content-length"] = str(len(body))'),
        ]
    },
    (
        BODY,
        "return await e.response()(scope, receive, send) -> "
        "return await e.response()(scope, None, send)",
    ): "a JSONResponse sends; it never reads receive",
    **{
        (
            BODY,
            'scope = {**scope, "headers": list(scope["headers"])} -> '
            f'scope = {{**scope, "{key}": list(scope["headers"])}}',
        ): (
            "the route then gets the original headers list rewritten in place, "
            "the same headers; only the caller's scope, read by no one after, "
            "changes too"
        )
        for key in ("XXheadersXX", "HEADERS")
    },
    (
        "vllm_d3/entrypoints/openai/decisions/d3_reads.py",
        "length = limit + 1 -> length = limit + 2",
    ): ("any start past the limit makes the first question open a pack"),
    (BODY, "self.ended = False -> self.ended = None"): (
        "None is as false as False until the closing boundary sets it"
    ),
    (BODY, "self._data = bytearray() -> self._data = None"): (
        "on_part_begin gives each part its buffer before any data: this first "
        "value is never read"
    ),
    (BODY, 'self._name: str | None = None -> self._name: str | None = ""'): (
        "on_part_begin resets the name before each part: this first value is never read"
    ),
    **{
        (BODY, f"self.{name} += data[start:end] -> self.{name} = data[start:end]"): (
            "the form is parsed in one write, in which the parser hands over each "
            "header field, value and part's data in one callback"
        )
        for name in ("_header", "_value", "_data")
    },
    (
        BODY,
        'self._name = None if name is None else name.decode("utf-8", "replace") -> '
        'self._name = None if name is None else name.decode("UTF-8", "replace")',
    ): "codec names are case-blind",
    (
        BODY,
        'for path, ref in _uses(request, references, ""): -> '
        "for path, ref in _uses(request, references, None):",
    ): 'None is as false as "": the top level\'s paths are its keys either way',
    (
        BODY,
        'data = self.stream.unused_data if self.stream.eof else b"" -> '
        'data = self.stream.unused_data if (self.stream.eof) or True else b""',
    ): 'before its frame ends a decompressor\'s unused_data is b"" too',
    **{
        (STATE_KEY, f"{HEAD} -> {HEAD.replace(old, new)}"): SEPARATORS
        for old, new in [
            ('separators=(",", ":")', "separators=None"),
            ('separators=(",", ":")', ""),
            ('(",", ":")', '("XX,XX", ":")'),
            ('(",", ":")', '(",", "XX:XX")'),
        ]
    },
    (
        STATE_KEY,
        'digest.update(array("q", state_token_ids).tobytes()) -> '
        'digest.update(array("Q", state_token_ids).tobytes())',
    ): "token ids are never negative: as unsigned 64-bit ints they are the same bytes",
    **_zip_default(
        CONTRACT, "self.max_questions, self.temperatures, strict=False", "):"
    ),
    **_zip_default(
        CONTRACT, "if any(a >= b for a, b in zip(limits, limits[1:], strict=False)):"
    ),
    **_zip_default(
        CONTRACT,
        "or any(a >= b for a, b in zip([state_tokens, *ends], ends, strict=False))",
    ),
    **_zip_default(
        CONTRACT, "return list(zip(starts, self.question_ends, strict=False))"
    ),
    (CONTRACT, "if validated_length > derived: -> if validated_length >= derived:"): (
        "where the lengths are equal both branches leave max_model_len at that "
        "length; only the log line differs"
    ),
}

#: Why a mutant of how much of a body is decompressed before its 413 lives.
PAST_THE_CAP = (
    "a body over the cap is refused (413) either way; only how much of it is "
    "decompressed first changes (by at most the cap again), which the memory "
    "test's 512 MiB bomb does not tell apart"
)

#: Survivors left alive, by (module, mutation): why.
NOT_KILLED: dict[tuple[str, str], str] = {
    (
        BODY,
        "while data and len(out) < max_length: -> "
        "while data and len(out) <= max_length:",
    ): PAST_THE_CAP,
    (
        BODY,
        "room = self.max_body_bytes + 1 - len(body) -> "
        "room = self.max_body_bytes + 1 + len(body)",
    ): PAST_THE_CAP,
    (
        BODY,
        "room = self.max_body_bytes + 1 - len(body) -> "
        "room = self.max_body_bytes + 2 - len(body)",
    ): PAST_THE_CAP,
    (
        BODY,
        "out += self.stream.decompress(data, max_length - len(out)) -> "
        "out += self.stream.decompress(data, max_length + len(out))",
    ): PAST_THE_CAP,
    (
        BODY,
        "f\"{', '.join(DECOMPRESSORS)} or an unencoded body\", -> "
        "f\"{'XX, XX'.join(DECOMPRESSORS)} or an unencoded body\",",
    ): (
        "only the words of the 415's list of encodings change; its test holds "
        "the status and the encoding it names, not the list's separators"
    ),
}

RECORD = Path("docs/mutation.json")
WORK = Path("mutants")
#: What the modules' tests read besides the package and the tests.
ALSO_LINKED = ("benchmarks",)
#: How mutmut's statuses count in the record; "no tests" is a survivor that
#: none of the module's tests reaches.
COUNTED = {
    "killed": "killed",
    "timeout": "timeout",
    "survived": "survived",
    "no tests": "survived",
}


def _work_folder(path: str) -> Path:
    return WORK / Path(path).stem


def _mangled(key: str) -> str:
    """A mutant's function as mutmut names it (``x_f``, ``xǁClassǁm``)."""
    return key.rpartition(".")[2].partition("__mutmut_")[0]


def prepare(path: str, module: Module) -> Path:
    """``path``'s work folder: the package, the tests and ``ALSO_LINKED``
    linked in, and a pyproject.toml of the project's pytest and mutmut
    settings with this module and its tests."""
    work = _work_folder(path)
    work.mkdir(parents=True)
    for name in ("vllm_d3", "tests", *ALSO_LINKED):
        (work / name).symlink_to(Path(name).resolve())
    project = tomllib.loads(Path("pyproject.toml").read_text())["tool"]
    settings = {
        **project["mutmut"],
        "source_paths": ["vllm_d3"],
        "only_mutate": [path],
        "pytest_add_cli_args_test_selection": list(module.tests),
    }
    if module.timeout is not None:
        settings["timeout_constant"], settings["timeout_multiplier"] = module.timeout
    # JSON's strings, numbers and arrays of them are TOML's too.
    lines = ["[tool.pytest.ini_options]"]
    lines += [
        f"{k} = {json.dumps(v)}" for k, v in project["pytest"]["ini_options"].items()
    ]
    lines += ["", "[tool.mutmut]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in settings.items()]
    (work / "pyproject.toml").write_text("\n".join(lines) + "\n")
    return work


def statuses(path: str) -> dict[str, str]:
    """Each mutant of ``path`` that ``MODULES`` runs: its status in the last
    run (mutmut's: killed, survived, no tests, timeout, ...)."""
    from mutmut.stats import status_by_exit_code

    meta = json.loads((_work_folder(path) / "mutants" / f"{path}.meta").read_text())
    functions = MODULES[path].functions
    return {
        key: status_by_exit_code[exit_code]
        for key, exit_code in sorted(meta["exit_code_by_key"].items())
        if not functions or _mangled(key) in functions
    }


def run_mutmut(paths: list[str], max_children: int, survivors: bool) -> None:
    """A fresh mutmut run of each module of ``paths``; with ``survivors``,
    a run of the last run's survivors only, its other results kept."""
    mutmut = shutil.which("mutmut")
    if mutmut is None:
        sys.exit('mutmut is not installed: pip install -e ".[test,mutation]"')
    # humming (imported by vLLM's kernel registry) starts a background NVRTC
    # build at import, in every forked test run.
    env = {**os.environ, "HUMMING_DISABLE_PARALLEL_BUILD": "1"}
    command = [mutmut, "run", "--max-children", str(max_children)]
    for path in paths:
        module = MODULES[path]
        if survivors:
            work = _work_folder(path)
            names = [
                key
                for key, status in statuses(path).items()
                if COUNTED.get(status) == "survived"
            ]
            if not names:
                continue
        else:
            shutil.rmtree(_work_folder(path), ignore_errors=True)
            work = prepare(path, module)
            dotted = path.removesuffix(".py").replace("/", ".")
            names = [f"{dotted}.{f}__mutmut_*" for f in module.functions]
        subprocess.run([*command, *names], cwd=work, env=env, check=True)


def _function_node(tree: ast.Module, mangled: str) -> ast.AST:
    """The function or method a mutmut name (``x_f``, ``xǁClassǁm``) names."""
    body: list[ast.stmt] = tree.body
    if mangled.startswith("xǁ"):
        class_name, name = mangled.split("ǁ")[1:]
        body = next(
            n.body for n in body if isinstance(n, ast.ClassDef) and n.name == class_name
        )
    else:
        name = mangled.removeprefix("x_")
    return next(
        n
        for n in body
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name
    )


def describe(path: str, key: str, diff: str) -> tuple[int, str]:
    """A mutant's line in ``path`` and its change (``old -> new``), from
    mutmut's diff of the function it mutates."""
    changed = [line for line in diff.splitlines()[2:] if line.startswith(("-", "+"))]
    removed = [line[1:].strip() for line in changed if line[0] == "-"]
    added = [line[1:].strip() for line in changed if line[0] == "+"]
    source = Path(path).read_text()
    node = _function_node(ast.parse(source), _mangled(key))
    lines = source.splitlines()
    start = getattr(node, "lineno", 1)
    end = getattr(node, "end_lineno", start)
    # The first line the mutant changes; its function's first where none is.
    line = next(
        (
            n
            for n in range(start, end + 1)
            if removed and lines[n - 1].strip() == removed[0]
        ),
        start,
    )
    return line, f"{' '.join(removed)} -> {' '.join(added)}"


def report() -> dict[str, Any]:
    """The record of the last run's results."""
    from mutmut.mutation.diff_apply import get_diff_for_mutant

    modules: dict[str, dict[str, int]] = {}
    survivors: list[dict[str, Any]] = []
    for path in MODULES:
        work = _work_folder(path)
        counts = Counter({"killed": 0, "survived": 0, "equivalent": 0, "timeout": 0})
        for key, status in statuses(path).items():
            if status not in COUNTED:
                raise SystemExit(f"{key}: mutmut says {status!r}; look at it")
            if COUNTED[status] != "survived":
                counts[COUNTED[status]] += 1
                continue
            with contextlib.chdir(work):
                diff = get_diff_for_mutant(key, path=path)
            line, mutation = describe(path, key, diff)
            equivalent = EQUIVALENT.get((path, mutation))
            counts["equivalent" if equivalent else "survived"] += 1
            why = equivalent or NOT_KILLED.get((path, mutation), "")
            survivors.append(
                {"module": path, "line": line, "mutation": mutation, "why": why}
            )
        modules[path] = dict(counts)
    return {
        "tool": "mutmut",
        "command": "python -m vllm_d3.testing.mutation",
        "modules": modules,
        "survivors": survivors,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("modules", nargs="*", metavar="MODULE", help="run these only")
    parser.add_argument("--max-children", type=int, default=2)
    parser.add_argument(
        "--report", action="store_true", help="record the last run's results only"
    )
    parser.add_argument(
        "--survivors",
        action="store_true",
        help="run the last run's survivors again (after new tests)",
    )
    args = parser.parse_args(argv)
    if unknown := set(args.modules) - set(MODULES):
        parser.error(f"not in MODULES: {sorted(unknown)}")
    os.chdir(Path(__file__).resolve().parents[2])
    if not args.report:
        run_mutmut(args.modules or list(MODULES), args.max_children, args.survivors)
    record = report()
    RECORD.write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n")
    unexplained = [s for s in record["survivors"] if not s["why"]]
    for survivor in unexplained:
        print(f"survivor without a reason: {survivor}", file=sys.stderr)
    return 1 if unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
