"""The state cache on one GPU: its answers against uncached ones, a control
keyed on a shared prefix only, and its speed (GPU).

``python -m benchmarks.state_cache --out DIR [--quick] [--seconds 60]
[--clients 16] [--serve-arg=FLAG ...]``

Contract:
- Answers: the validation's prefix_bidir checkpoint and sets (``--quick``, as
  the validation's) over ``/v1/systemone``, from ``vllm serve`` with
  ``--no-enable-prefix-caching``, then with ``--enable-prefix-caching``, a
  KV cache of ``CACHED_KV_CACHE_BYTES`` and every state longer than a block
  read alone (``d3_state_cache_min_tokens`` 0: the sets' states are short).
  With, every set goes three times: ``cold``, ``cached`` (its states read
  before) and ``after eviction`` (after other states of about
  ``EVICT_FACTOR`` times the KV cache's tokens went through). Each pass
  against the uncached answers (``compare``), with the tokens it took from the
  cache (vLLM's ``/metrics``).
- Control: ``vllm_d3.testing.state_cache_reads`` on the same checkpoint, in a
  process of its own: a state that differs from one read before in every
  token after their shared whole blocks, read with the key left out, against
  it read uncached (max |dp|).
- Speed: the d3-turbo-shaped package (random weights) at ``--max-model-len``
  ``SPEED_MAX_MODEL_LEN``, uncached then cached (each flag given): after an
  untimed request of the same size, a ``REPEAT_TOKENS`` state with 2
  questions sent twice (each timed); per ``SHORT_ROWS`` row, the p50 of
  ``SHORT_REPEATS`` requests, each a state never read (what the cache costs
  a miss); then ``--clients`` clients for ``--seconds``, each sending pages
  one after another: a ``PAGE_TOKENS`` state with ``PAGE_QUESTIONS``
  questions as ``PAGE_REQUESTS`` requests at once, then its next page;
  pages/s: the requests answered within the window, ``PAGE_REQUESTS`` to a
  page, over the time to the last. The requests both sides answered: their
  answers compared.
- ``--parts`` runs some of ``PARTS`` only. Writes each part (and each speed
  side) to ``OUT/<part>.json`` as it ends, then, once every part is in
  ``OUT`` (this run's or an earlier run's with the same ``OUT``),
  ``OUT/state-cache.json`` with the keys ``SUMMARY_KEYS`` and the details,
  and ``OUT/state-cache.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from vllm_d3.model_executor.models.d3_contract import STATE_CACHE_MIN_TOKENS_KEY
from vllm_d3.testing.compare import compare, flatten
from vllm_d3.testing.own_process import logits_from_script
from vllm_d3.testing.requests import questions, text_state, words_per_token
from vllm_d3.testing.server import Server

from .rows import ROWS_BY_ID, row_requests
from .startup import package
from .timing import log, run_record
from .validation import (
    build_checkpoints,
    scaled_sets,
    server_flags,
)
from .vllm_side import metric_sums, metrics_text, serve_flags, systemone

ROUTE = "/v1/systemone"
PASSES = ("cold", "cached", "after eviction")
PARTS = ("answers", "control", "speed")
#: The states that evict the sets' ones: this many times the KV cache's tokens.
EVICT_FACTOR = 1.5
#: The longest eviction state, within the validation checkpoint's length.
EVICT_STATE_TOKENS = 30_000
#: The cached server's KV cache: small, so that eviction takes few states
#: (the tiny checkpoint's KV cache holds about 520K tokens a GiB uncached).
CACHED_KV_CACHE_BYTES = 2**30
REPEAT_TOKENS = 64_000
#: The speed servers' length: the repeated state and its questions, with room
#: (each start's profile step is sized by it).
SPEED_MAX_MODEL_LEN = 81_920
PAGE_TOKENS, PAGE_QUESTIONS, PAGE_REQUESTS = 47_000, 26, 4
#: The short requests timed on either side, each a new state (what the cache
#: costs a miss): the text row's state is shorter than a block, the photo
#: row's longer; and how often.
SHORT_ROWS, SHORT_REPEATS = ("text-16", "photo-8"), 10
SUMMARY_KEYS = (
    "repeat_64k_first_s",
    "repeat_64k_second_s",
    "repeat_64k_uncached_s",
    "pages_per_s_cached",
    "pages_per_s_uncached",
    "validation_max_dp",
    "decisions_changed",
    "control_max_dp",
)
SPEED_COLUMNS = (
    "repeat_first_s",
    "repeat_second_s",
    *(f"{row}_p50_s" for row in SHORT_ROWS),
    "pages_per_s",
)
#: vLLM's counters of its requests' prompt tokens, and of those taken from
#: the cache.
PROMPT_TOKENS_METRIC = "vllm:prompt_tokens_total"
CACHED_TOKENS_METRIC = "vllm:prompt_tokens_cached_total"
KV_CACHE_TOKENS = re.compile(r"KV cache size: ([\d,]+) tokens")


def kv_cache_tokens(log_text: str) -> int:
    """The KV cache's size in tokens, as the server logged it."""
    found = KV_CACHE_TOKENS.search(log_text)
    if found is None:
        raise ValueError("the server log names no KV cache size")
    return int(found.group(1).replace(",", ""))


def split_questions(asked: dict[str, Any], parts: int) -> list[dict[str, Any]]:
    """``asked`` in ``parts`` requests' worth, as even as they go, in order."""
    names = list(asked)
    size, extra = divmod(len(names), parts)
    chunks, start = [], 0
    for part in range(parts):
        end = start + size + (part < extra)
        chunks.append({name: asked[name] for name in names[start:end]})
        start = end
    return chunks


def send_sets(url: str, sets: dict[str, list[dict]]) -> tuple[dict, int]:
    """Every set's answers, and the tokens their requests took from the cache
    (``/v1/systemone``'s usage has no such field: vLLM's ``/metrics`` counts
    them)."""
    before = prompt_tokens(url)["cached"]
    answers = {name: [systemone(url, r) for r in rs] for name, rs in sets.items()}
    return answers, prompt_tokens(url)["cached"] - before


def prompt_tokens(url: str) -> dict[str, int]:
    """The prompt tokens of the requests the server prefilled so far
    (``"prompt"``) and those it took from its cache (``"cached"``)."""
    names = (PROMPT_TOKENS_METRIC, CACHED_TOKENS_METRIC)
    sums = metric_sums(metrics_text(url), names)
    return {
        "prompt": int(sums.get(PROMPT_TOKENS_METRIC, 0)),
        "cached": int(sums.get(CACHED_TOKENS_METRIC, 0)),
    }


def evict(url: str, rng: random.Random, tokens: int, per_token: float) -> int:
    """Send states of ``tokens`` tokens in all, never seen before; returns the
    tokens sent."""
    sent = 0
    while sent < tokens:
        state_tokens = min(EVICT_STATE_TOKENS, tokens - sent)
        words = max(1, int(state_tokens * per_token))
        systemone(
            url, {"state": text_state(rng, words), "questions": questions(rng, 1)}
        )
        sent += state_tokens
    return sent


def answers_part(args: argparse.Namespace, checkpoint: str, per_token: float) -> dict:
    """The three passes against uncached answers, per set, on the validation's
    ``checkpoint``."""
    sets = scaled_sets(checkpoint, quick=args.quick)
    # The long sets need the longer length, as in the validation.
    plain = server_flags(not args.quick, {}, args.serve_arg)
    uncached_flags = ["--no-enable-prefix-caching", *plain]
    with Server(checkpoint, *uncached_flags, log_file=args.out / "serve.log") as server:
        server.wait()
        uncached, _ = send_sets(server.url, sets)
    log("answers: uncached")
    # Every state longer than a block read alone, the sets' short ones too,
    # so that each pass's hits are the ones under test.
    cached_args = {
        "additional_config": json.dumps({STATE_CACHE_MIN_TOKENS_KEY: 0}),
        "kv_cache_memory_bytes": CACHED_KV_CACHE_BYTES,
    }
    flags = [
        "--enable-prefix-caching",
        *server_flags(not args.quick, cached_args, args.serve_arg),
    ]
    log_file = args.out / "serve-cached.log"
    passes: dict[str, Any] = {}
    with Server(checkpoint, *flags, log_file=log_file) as server:
        server.wait()
        capacity = kv_cache_tokens(log_file.read_text())
        for name in PASSES:
            evicted = 0
            if name == "after eviction":
                rng = random.Random(1)
                evicted = evict(
                    server.url, rng, int(EVICT_FACTOR * capacity), per_token
                )
            answers, cached = send_sets(server.url, sets)
            passes[name] = {
                "cached_tokens": cached,
                "evicted_tokens": evicted,
                "sets": {
                    n: compare(flatten(uncached[n]), flatten(answers[n])) for n in sets
                },
            }
            log(f"answers: {name}, {cached} tokens from the cache")
    return {"kv_cache_tokens": capacity, "passes": passes}


def control_part(checkpoint: str, work: Path) -> dict:
    """The unkeyed hit against the same request uncached, in probabilities."""
    codes = len(
        json.loads((Path(checkpoint) / "decision_config.json").read_text())["codes"]
    )
    logits = logits_from_script(
        _reads_script(), checkpoint, work / "state-cache-reads.pt"
    )

    def probabilities(name: str) -> torch.Tensor:
        return logits[name].float().view(-1, codes).softmax(-1)

    return {
        "control_max_dp": float(
            (probabilities("other, unkeyed") - probabilities("other, uncached"))
            .abs()
            .max()
        ),
        "control_cached_tokens": logits["other, unkeyed cached"].tolist(),
        "packed_cached_max_dp": float(
            (probabilities("packed, cached") - probabilities("uncached")).abs().max()
        ),
    }


def _reads_script() -> str:
    from vllm_d3.testing import state_cache_reads

    return state_cache_reads.__file__


async def _pages_per_s(
    url: str, pages: list[list[dict]], clients: int, seconds: float
) -> tuple[float, dict[tuple[int, int], dict]]:
    """Pages per second of ``clients`` clients over ``seconds``, each sending a
    page's requests at once, then the next page: the requests answered by
    then, ``PAGE_REQUESTS`` to a page, over the time to the last of them; and
    their replies, by (page, request). Requests still being asked at the end
    are given up, so the window ends on time, and whole pages need not end in
    it (at 16 clients on uncached states one may take minutes)."""
    answered: list[float] = []
    replies: dict[tuple[int, int], dict] = {}
    queue = enumerate(pages)

    async def ask(client: httpx.AsyncClient, page: int, part: int, body: dict):
        reply = await client.post(url + ROUTE, json=body)
        reply.raise_for_status()
        replies[page, part] = reply.json()
        answered.append(time.monotonic())

    async def client_loop(client: httpx.AsyncClient) -> None:
        for page, requests in queue:
            await asyncio.gather(
                *(ask(client, page, part, body) for part, body in enumerate(requests))
            )

    started = time.monotonic()
    async with httpx.AsyncClient(timeout=None) as client:
        loops = [asyncio.ensure_future(client_loop(client)) for _ in range(clients)]
        ended, running = await asyncio.wait(loops, timeout=seconds)
        for loop in running:
            loop.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        for loop in ended:
            loop.result()  # a client that failed fails the run
    if not answered:
        raise RuntimeError(f"no request answered in {seconds} s")
    return len(answered) / PAGE_REQUESTS / (answered[-1] - started), replies


def make_pages(rng: random.Random, count: int, per_token: float) -> list[list[dict]]:
    """``count`` pages, each a new state asked as ``PAGE_REQUESTS`` requests."""
    pages = []
    for _ in range(count):
        state = text_state(rng, int(PAGE_TOKENS * per_token))
        asked = questions(rng, PAGE_QUESTIONS)
        parts = split_questions(asked, PAGE_REQUESTS)
        pages.append([{"state": state, "questions": part} for part in parts])
    return pages


def timed(url: str, request: dict) -> float:
    started = time.monotonic()
    systemone(url, request)
    return time.monotonic() - started


def p50_after_one(url: str, requests: list[dict]) -> float:
    """The p50 of ``requests`` after the first (the shape's first call: its
    compilations), timed one at a time."""
    timed(url, requests[0])
    return statistics.median(timed(url, r) for r in requests[1:])


def speed_part(args: argparse.Namespace, work: Path) -> dict:
    """The repeated 64K state, short requests and the pages, uncached then
    cached; the answers of the page requests both sides answered, against
    each other."""
    checkpoint = str(package(work, "prefix_bidir"))
    from transformers import AutoTokenizer

    per_token = words_per_token(AutoTokenizer.from_pretrained(checkpoint))
    rng = random.Random(0)
    # The first, untimed, warms the server up (first-call compilations).
    warm_up, repeat = (
        {
            "state": text_state(rng, int(REPEAT_TOKENS * per_token)),
            "questions": questions(rng, 2),
        }
        for _ in range(2)
    )
    # Each a state of its own: what a miss costs a short request.
    shorts = {
        row: row_requests(
            ROWS_BY_ID[row], 1 + SHORT_REPEATS, seed=0, words_per_token=per_token
        )
        for row in SHORT_ROWS
    }
    # Pages enough for either side; each state is read by one page only.
    pages = make_pages(rng, args.pages, per_token)
    results: dict[str, Any] = {}
    replies = {}
    sides = (
        ("uncached", ["--no-enable-prefix-caching"]),
        ("cached", ["--enable-prefix-caching"]),
    )
    for side, flags in sides:
        # The package has no weights (vllm_side's rule).
        all_flags = serve_flags(
            checkpoint,
            ["--max-model-len", str(SPEED_MAX_MODEL_LEN), *flags, *args.serve_arg],
        )
        log_file = args.out / f"serve-speed-{side}.log"
        with Server(checkpoint, *all_flags, log_file=log_file) as server:
            server.wait(900)
            timed(server.url, warm_up)
            first, second = timed(server.url, repeat), timed(server.url, repeat)
            short_p50s = {
                f"{row}_p50_s": p50_after_one(server.url, requests)
                for row, requests in shorts.items()
            }
            before = prompt_tokens(server.url)
            rate, replies[side] = asyncio.run(
                _pages_per_s(server.url, pages, args.clients, args.seconds)
            )
            # What the pages' requests prefilled in the window, and took cached.
            after = prompt_tokens(server.url)
            page_tokens = {k: after[k] - before[k] for k in after}
        results[side] = saved(
            args.out,
            f"speed-{side}",
            {
                "repeat_first_s": first,
                "repeat_second_s": second,
                **short_p50s,
                "pages_per_s": rate,
                "pages_prompt_tokens": page_tokens["prompt"],
                "pages_cached_tokens": page_tokens["cached"],
            },
        )
        log(f"speed, {side}: {first:.2f} s, then {second:.2f} s; {rate:.2f} pages/s")
    both = sorted(replies["uncached"].keys() & replies["cached"].keys())
    results["requests_both_answered"] = len(both)
    if both:
        results["pages_against_uncached"] = compare(
            *(flatten([replies[side][key] for key in both]) for side in replies)
        )
    return results


def summary(answers: dict, control: dict, speed: dict) -> dict[str, Any]:
    """The issue's keys from the three parts."""
    tables = [t for p in answers["passes"].values() for t in p["sets"].values()]
    return {
        "repeat_64k_first_s": speed["cached"]["repeat_first_s"],
        "repeat_64k_second_s": speed["cached"]["repeat_second_s"],
        "repeat_64k_uncached_s": speed["uncached"]["repeat_first_s"],
        "pages_per_s_cached": speed["cached"]["pages_per_s"],
        "pages_per_s_uncached": speed["uncached"]["pages_per_s"],
        "validation_max_dp": max(t["max_dp"] for t in tables),
        "decisions_changed": sum(t["decisions_changed"] for t in tables),
        "control_max_dp": control["control_max_dp"],
    }


def saved(out: Path, part: str, results: dict) -> dict:
    """``results`` of one part, also written to ``OUT/part.json`` at once, so
    that a run stopped later keeps them."""
    (out / f"{part}.json").write_text(json.dumps(results, indent=1))
    return results


def write_summary(out: Path, done: dict[str, Any]) -> bool:
    """``OUT/state-cache.json`` and ``.md`` from this run's parts (``done``)
    and the others' files in ``out``; False, writing nothing, while a part is
    missing."""
    files = {part: out / f"{part}.json" for part in PARTS}
    earlier = {
        part: json.loads(f.read_text()) for part, f in files.items() if f.exists()
    }
    parts = earlier | done
    if len(parts) < len(PARTS):
        return False
    results = {
        "run": run_record(),
        "summary": summary(parts["answers"], parts["control"], parts["speed"]),
        **{part: parts[part] for part in PARTS},
    }
    (out / "state-cache.json").write_text(json.dumps(results, indent=1))
    (out / "state-cache.md").write_text(report(results))
    return True


def report(results: dict[str, Any]) -> str:
    lines = ["# The state cache on one GPU", "", "| key | value |", "|---|---|"]
    lines += [f"| {k} | {results['summary'][k]} |" for k in SUMMARY_KEYS]
    speed = results["speed"]
    lines += ["", f"| side | {' | '.join(SPEED_COLUMNS)} |"]
    lines += ["|---" * (1 + len(SPEED_COLUMNS)) + "|"]
    lines += [
        f"| {side} | {' | '.join(f'{speed[side][c]:.3f}' for c in SPEED_COLUMNS)} |"
        for side in ("uncached", "cached")
    ]
    for name, done in results["answers"]["passes"].items():
        lines += ["", f"## {name} ({done['cached_tokens']} tokens from the cache)", ""]
        lines += [
            "| set | questions | decisions changed (near ties) | max dp |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {n} | {t['questions']} | {t['decisions_changed']} "
            f"({t['changed_near_ties']}) | {t['max_dp']:.4f} |"
            for n, t in done["sets"].items()
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--pages", type=int, default=400)
    parser.add_argument("--serve-arg", action="append", default=[])
    parser.add_argument("--parts", help=f"some of {','.join(PARTS)} (default: all)")
    args = parser.parse_args(argv)
    parts = PARTS if args.parts is None else tuple(args.parts.split(","))
    if unknown := set(parts) - set(PARTS):
        parser.error(f"--parts: no part {', '.join(sorted(unknown))}")
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.out / "work"
    work.mkdir(exist_ok=True)
    from transformers import AutoTokenizer

    # Each part keeps the settings of the run that made it.
    settings = {"settings": {k: str(v) for k, v in vars(args).items()}}
    done: dict[str, Any] = {}
    if "answers" in parts or "control" in parts:
        checkpoint = build_checkpoints(work / "checkpoints")["prefix_bidir"]
    if "answers" in parts:
        per_token = words_per_token(AutoTokenizer.from_pretrained(checkpoint))
        answers = answers_part(args, checkpoint, per_token)
        done["answers"] = saved(args.out, "answers", answers | settings)
    if "control" in parts:
        control = control_part(checkpoint, work)
        done["control"] = saved(args.out, "control", control | settings)
    if "speed" in parts:
        speed = speed_part(args, work)
        done["speed"] = saved(args.out, "speed", speed | settings)
    write_summary(args.out, done)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
