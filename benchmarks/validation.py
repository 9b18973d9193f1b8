"""End-to-end validation of vLLM + vllm-d3 against the reference runtime (GPU).

``python -m benchmarks.validation run --out DIR [--quick] [--parallel]
[--serve-arg=FLAG ...] [--gdn-prefill-backend KERNEL] [--http-only]
[--reference-cache CACHE]`` builds tiny
checkpoints (prefix_bidir with a vision tower, causal, noncausal_full_attention),
the seeded request sets of ``requests.py``, and then, each served by vLLM with no
flag beyond what a user passes (``--max-model-len 131072`` for the long states;
``--gdn-prefill-backend KERNEL`` forces a Gated DeltaNet prefill kernel):

- reference answers (``vllm_d3.reference``, float32; on the CPU, and on the GPU
  for the long states only) under the checkpoint's mask, and under the causal
  and whole-prompt-bidirectional masks for the controls;
- in process: ``LLM.classify`` with each prompt's state size in ``PoolingParams``
  (text sets), and the same prompts with the state size withheld, i.e. sent as
  one block covering the whole prompt (negative control); every short text
  request packed (``packed_prompt``: its state once, then its questions), all
  sent at once so that packs of different states and question counts share a
  step, against the one-prompt-per-question answers, and the same packs with
  each second question's block joined to the one before (negative control);
- over HTTP: ``vllm serve`` on loopback, ``POST /v1/systemone`` for every set,
  the /classify list form (two inputs, one size each), bad inputs that must be
  4xx, a zstd body that decodes to ``BOMB_BYTES`` (a 413), and a valid request
  after them; the image sets and the longest text state again from the
  typesafe-sdk as published (``sdk_answers``: zstd bodies, images as multipart
  assets); and the same, but for the SDK and the bomb, on a second server that
  reads one question per request (``--additional-config
  '{"d3_state_once": false}'``), whose answers the default server's must meet
  within ``STATE_ONCE_TOLERANCE`` (the same engine, the state read once or once
  per question);
- ``--enable-chunked-prefill`` on the prefix_bidir checkpoint (must be refused);
- the causal and noncausal checkpoints in process against their own mode.

It writes ``DIR/results.json`` and ``DIR/validation.md`` (generated from the run,
with the GPU, versions and command; ``report`` rewrites the markdown from a
``results.json``). Each vLLM instance runs in a subprocess of this module
(``inprocess``, its output in ``WORK/<tag>-inprocess.log``) or as a server
(``WORK/serve*.log``): one at a time, or at once with ``--parallel`` (each with
``PARALLEL_MEMORY`` of the GPU's memory and a fixed KV cache size: engines that
profile their memory at the same moment count each other's allocations as their
own). A failure message ends with the log's last exception line. ``--dtype``
serves in another dtype than the checkpoint's. The reference also runs on the
GPU for the short text sets, a check that its GPU kernels agree with its CPU
ones (the long states rely on them); ``results.json`` keeps every answer.
``--reference-cache`` keeps the reference's answers by what they depend on, so
that runs of other kernels or flags reuse them; ``references --work W --cache
CACHE`` fills it ahead of a run (the CPU ones on any machine).
"""

import argparse
import base64
import functools
import hashlib
import json
import platform
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from vllm_d3.model_executor.models.d3_contract import (
    QUESTION_ENDS_KEY,
    STATE_ONCE_KEY,
    STATE_TOKENS_KEY,
)
from vllm_d3.testing.compare import (
    CONTROL_MARGIN,
    STATE_ONCE_TOLERANCE,
    TIE,
    TOLERANCE,
    clearly_wrong,
    compare,
    flatten,
    passes,
)
from vllm_d3.testing.requests import request_sets, words_per_token
from vllm_d3.testing.server import (
    Server,
    ServerExited,
    last_error,
    post,
    served_max_model_len,
)

from .timing import run_record

LONG_MAX_MODEL_LEN = 131072
#: What the zstd body sent to check the decompression limit decodes to.
BOMB_BYTES = 2**30
PARALLEL_MEMORY = 0.15
PARALLEL_KV_CACHE_BYTES = 4 * 2**30
#: d3-turbo declares it (vLLM's max-model-len without a flag); so do the
#: validation checkpoints.
VALIDATED_LENGTH = 32768
#: The request sets with long states (their names start so).
LONG_SETS = ("24K", "64K")
GPU_CHECK_TABLE = "check: reference on the GPU vs on the CPU"
OTHER_MODES = ("causal", "noncausal_full_attention")
MODES = ("prefix_bidir", *OTHER_MODES)


def log(message: str) -> None:
    print(f"[validation {time.strftime('%H:%M:%S')}] {message}", flush=True)


# ---------------------------------------------------------------- checkpoints


def build_checkpoints(root: Path) -> dict[str, str]:
    from vllm_d3.testing.tiny_checkpoint import write_tiny_checkpoint

    paths = {}
    for mode in MODES:
        path = root / mode
        if not (path / "decision_config.json").exists():
            # Like d3-turbo, each declares a validated length: it also keeps the
            # engines' prefill budget (and so their memory profile) small.
            write_tiny_checkpoint(
                path,
                attention_mode=mode,
                vision=True,
                validated_length=VALIDATED_LENGTH,
            )
        paths[mode] = str(path)
    return paths


def scaled_sets(checkpoint: str, *, quick: bool) -> dict[str, list[dict[str, Any]]]:
    """The request sets, with the long states sized in this tokenizer's tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    return request_sets(
        0,
        per_set=1 if quick else 2,
        long=not quick,
        words_per_token=words_per_token(tokenizer),
    )


# ------------------------------------------------------------------ reference


#: Packages whose kernels transformers binds to Qwen3.5's Gated DeltaNet when it
#: can import them, whatever the device; they run on CUDA only.
GPU_ONLY_KERNEL_PACKAGES = ("fla", "causal_conv1d")
#: This module's command line, for the subprocesses it runs itself.
SELF_COMMAND = (sys.executable, "-m", "benchmarks.validation")


def reference_key(
    checkpoint: str, sets: dict[str, list[dict]], attention: str | None, device: str
) -> str:
    """What a reference answer depends on: every file of the checkpoint, the
    requests, the mask and the device."""
    digest = hashlib.sha256()
    root = Path(checkpoint)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    digest.update(json.dumps([sets, attention, device], sort_keys=True).encode())
    return digest.hexdigest()


def reference_answers(
    checkpoint: str,
    sets: dict[str, list[dict]],
    attention: str | None,
    device: str,
    cache: Path | None = None,
) -> dict[str, list[dict]]:
    """The reference's answers to every request of ``sets``, in float32; with
    ``cache``, read from there when an earlier run (on any machine) computed
    them for the same ``reference_key``, and written there otherwise."""
    if cache is None:
        return _reference_answers_computed(checkpoint, sets, attention, device)
    entry = cache / f"{reference_key(checkpoint, sets, attention, device)}.json"
    if entry.exists():
        log(f"reference {attention or 'checkpoint mode'} on {device}: {entry.name}")
        return json.loads(entry.read_text())
    answers = _reference_answers_computed(checkpoint, sets, attention, device)
    cache.mkdir(parents=True, exist_ok=True)
    entry.write_text(json.dumps(answers))
    return answers


def _reference_answers_computed(
    checkpoint: str,
    sets: dict[str, list[dict]],
    attention: str | None,
    device: str,
) -> dict[str, list[dict]]:
    """On the CPU the answers come from a subprocess (the ``reference``
    command) that cannot import ``GPU_ONLY_KERNEL_PACKAGES``, so transformers
    runs its PyTorch code there even on a machine that has them."""
    if device != "cpu":
        return _reference_answers_here(checkpoint, sets, attention, device)
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        sets_file, out_file = Path(scratch, "sets.json"), Path(scratch, "out.json")
        sets_file.write_text(json.dumps(sets))
        command = [*SELF_COMMAND, "reference", checkpoint, str(sets_file)]
        command += [str(out_file)]
        command += ["--attention", attention] if attention else []
        subprocess.run(command, check=True)
        return json.loads(out_file.read_text())


def _reference_answers_here(
    checkpoint: str,
    sets: dict[str, list[dict]],
    attention: str | None,
    device: str,
) -> dict[str, list[dict]]:
    import torch

    from vllm_d3.reference import ReferenceRuntime

    runtime = ReferenceRuntime(checkpoint, device=device, dtype=torch.float32)
    out = {}
    for name, requests in sets.items():
        long = name.startswith(LONG_SETS)
        path = (
            "state_once"
            if long and attention in (None, "prefix_bidir")
            else "per_question"
        )
        out[name] = [
            runtime.answer(r, path=path, attention=attention) for r in requests
        ]
        log(f"reference {attention or 'checkpoint mode'} on {device}: {name}")
    del runtime
    torch.cuda.empty_cache()
    return out


# ----------------------------------------------------------------- in process


def _answer_from_logits(
    question: dict, logits: list[float], temperature: float
) -> dict:
    kind, criteria = question["type"], question.get("criteria") or {}
    if kind == "noul":
        names = ["false", "true"]
    elif kind == "score":
        names = [str(i) for i in range(len(criteria))]
    else:
        names = list(criteria)
    # The softmax 0.33.0's read strategies apply to a question's own codes.
    from vllm.entrypoints.openai.decisions.question_types import label_softmax

    probs = label_softmax([v / temperature for v in logits[: len(names)]])
    if kind == "noul":
        return {
            "type": "noul",
            "probabilities": {"yes": probs[1], "no": probs[0]},
            "noul": probs[1],
        }
    return {"type": kind, "probabilities": dict(zip(names, probs, strict=True))}


def packed_prompt(
    questions: list[Any], merge_pairs: bool = False
) -> tuple[list[int], dict[str, Any], list[int]]:
    """A request's rendered questions as one prompt ``state || q1 || ... || qQ``:
    its token ids, its ``extra_kwargs`` and the indexes of the questions read
    out. ``merge_pairs`` is the negative control: each second question's block
    is joined to the one before, so that question reads the other's tokens
    (and the last question of an odd count stands alone)."""
    s = questions[0].state_tokens
    ids = list(questions[0].token_ids[:s])
    ends = []
    for q in questions:
        if q.state_tokens != s or q.token_ids[:s] != ids[:s]:
            raise ValueError("the questions of a request do not share their state")
        ids += q.token_ids[s:]
        ends.append(len(ids))
    read = list(range(len(questions)))
    if merge_pairs:
        read = [i for i in read if i % 2 == 1 or i == len(questions) - 1]
    extra = {STATE_TOKENS_KEY: s, QUESTION_ENDS_KEY: [ends[i] for i in read]}
    return ids, extra, read


def run_inprocess(
    checkpoint: str,
    sets_file: str,
    out_file: str,
    long: bool,
    engine_args: dict[str, Any],
) -> None:
    """LLM.classify over the reference-rendered prompts of every text set, with
    and without (one whole-prompt block) the state sizes. On a prefix_bidir
    checkpoint also every short set's requests packed (``packed_prompt``), all
    sent at once, and the same with question pairs merged (the control)."""
    from vllm import LLM

    from vllm_d3.model_executor.models.d3_contract import is_prefix_bidir
    from vllm_d3.reference import ReferenceRuntime

    sets = json.loads(Path(sets_file).read_text())
    renderer = ReferenceRuntime(checkpoint, device="cpu")
    decision = json.loads((Path(checkpoint) / "decision_config.json").read_text())
    prefix_bidir = is_prefix_bidir(decision)
    kwargs: dict[str, Any] = {"model": checkpoint}
    kwargs.update(engine_args)
    if long:
        kwargs["max_model_len"] = LONG_MAX_MODEL_LEN
    started = time.time()
    llm = LLM(**kwargs)
    log(f"in-process LLM up in {time.time() - started:.0f}s")
    temperature_of = _temperature_rule(decision)
    results: dict[str, Any] = {}
    # (set name, request, its rendered questions) of every short text set.
    packable: list[tuple[str, dict, list]] = []
    for name, requests in sets.items():
        if any(r.get("images") or r.get("videos") for r in requests):
            continue
        rendered = [renderer.render(r) for r in requests]
        if prefix_bidir and not name.startswith(LONG_SETS):
            packable += zip([name] * len(requests), requests, rendered, strict=True)
        variants = ("served", "one block") if prefix_bidir else ("served",)
        for variant in variants:
            responses = _classify_set(
                llm, requests, rendered, variant, prefix_bidir, temperature_of
            )
            results.setdefault(variant, {})[name] = responses
        log(f"in-process: {name}")
    if packable:
        results.update(_classify_packed(llm, packable, temperature_of))
    Path(out_file).write_text(json.dumps(results))


def _temperature_rule(decision: dict[str, Any]) -> Callable[[int], float]:
    """The temperature of a request of n questions (d3-ultra's schedule, else
    the checkpoint's one temperature)."""
    from vllm_d3.model_executor.models.d3_contract import temperature_schedule_of

    schedule = temperature_schedule_of(decision)
    if schedule:
        return schedule.temperature_for
    return lambda questions: decision.get("temperature", 1.0)


def _classify_set(
    llm: Any,
    requests: list[dict],
    rendered: list[list],
    variant: str,
    prefix_bidir: bool,
    temperature_of: Callable[[int], float],
) -> list[dict]:
    """One set's responses, a prompt per question: ``served`` with each
    prompt's state size, ``one block`` with the whole prompt as its state."""
    from vllm import PoolingParams
    from vllm.inputs import TokensPrompt

    questions = [q for qs in rendered for q in qs]
    params = [
        PoolingParams(
            task="classify",
            use_activation=False,
            extra_kwargs=None
            if not prefix_bidir
            else {
                "d3_state_tokens": q.state_tokens
                if variant == "served"
                else len(q.token_ids)
            },
        )
        for q in questions
    ]
    prompts = [TokensPrompt(prompt_token_ids=q.token_ids) for q in questions]
    outputs = iter(llm.classify(prompts, pooling_params=params, use_tqdm=False))
    responses = []
    for request, asked in zip(requests, rendered, strict=True):
        temperature = temperature_of(len(asked))
        answers = {
            q.qid: _answer_from_logits(
                request["questions"][q.qid], next(outputs).outputs.probs, temperature
            )
            for q in asked
        }
        responses.append({"answers": answers})
    return responses


def _classify_packed(
    llm: Any,
    packable: list[tuple[str, dict, list]],
    temperature_of: Callable[[int], float],
) -> dict[str, Any]:
    """Every packable request packed, all sent at once, and the same with
    question pairs merged; with ``packed_batch``, what the batch held."""
    from vllm import PoolingParams
    from vllm.inputs import TokensPrompt

    results: dict[str, Any] = {}
    for variant, merge_pairs in (("packed", False), ("packed, pairs merged", True)):
        packs = [packed_prompt(questions, merge_pairs) for _, _, questions in packable]
        # Every pack goes to the engine at once: vLLM's scheduler (no chunked
        # prefill) takes as many as one step's token budget holds.
        outputs = iter(
            llm.classify(
                [TokensPrompt(prompt_token_ids=ids) for ids, _, _ in packs],
                pooling_params=[
                    PoolingParams(task="classify", use_activation=False, extra_kwargs=x)
                    for _, x, _ in packs
                ],
                use_tqdm=False,
            )
        )
        for (name, request, questions), (_, _, read) in zip(
            packable, packs, strict=True
        ):
            # One readout per question read, its codes one after the other.
            logits = next(outputs).outputs.probs
            width = len(logits) // len(read)
            answers = {
                questions[i].qid: _answer_from_logits(
                    request["questions"][questions[i].qid],
                    logits[k * width : (k + 1) * width],
                    temperature_of(len(questions)),
                )
                for k, i in enumerate(read)
            }
            results.setdefault(variant, {}).setdefault(name, []).append(
                {"answers": answers}
            )
        log(f"in-process: {len(packs)} requests {variant}")
        scheduler = llm.llm_engine.vllm_config.scheduler_config
        # Both variants send the same tokens, only their ends differ.
        results["packed_batch"] = {
            "prompts": len(packs),
            "tokens": sum(len(ids) for ids, _, _ in packs),
            "question_counts": sorted({len(q) for _, _, q in packable}),
            "max_num_batched_tokens": scheduler.max_num_batched_tokens,
        }
    return results


class InProcess:
    """``run_inprocess`` in a subprocess of its own (one vLLM engine each)."""

    def __init__(
        self,
        checkpoint: str,
        sets: dict,
        work: Path,
        tag: str,
        long: bool,
        engine_args: dict[str, Any],
    ):
        sets_file = work / f"{tag}-sets.json"
        self.out_file = work / f"{tag}-inprocess.json"
        sets_file.write_text(json.dumps(sets))
        command = [*SELF_COMMAND, "inprocess", checkpoint, str(sets_file)]
        command += [str(self.out_file)]
        command += ["--long"] if long else []
        command += [f"--engine-arg={k}={json.dumps(v)}" for k, v in engine_args.items()]
        self.tag = tag
        self.log_file = work / f"{tag}-inprocess.log"
        with self.log_file.open("w") as output:
            self.process = subprocess.Popen(
                command, stdout=output, stderr=subprocess.STDOUT
            )

    def result(self) -> dict:
        code = self.process.wait()
        if code != 0:
            raise RuntimeError(
                f"the in-process run of {self.tag} exited with {code} "
                f"({self.log_file.name}): {last_error(self.log_file)}"
            )
        return json.loads(self.out_file.read_text())


def classify_list_form(prompt_ids: list[int], state_tokens: int) -> dict:
    """A /classify body of two inputs with one state block size each."""
    return {
        "input": [prompt_ids, prompt_ids[:-1]],
        "d3_state_tokens": [state_tokens, state_tokens],
    }


def bad_inputs(
    prompt_ids: list[int], state_tokens: int, max_model_len: int
) -> list[tuple[str, str, dict]]:
    """(what, route, body) of requests that must get a 4xx."""
    q = {"q": {"type": "noul", "instructions": "Is it?"}}
    classify = {"input": [prompt_ids]}
    two = classify_list_form(prompt_ids, state_tokens)
    return [
        ("d3_state_tokens true", "/classify", {**classify, "d3_state_tokens": True}),
        (
            "d3_state_tokens list, one value for two inputs",
            "/classify",
            {**two, "d3_state_tokens": [state_tokens]},
        ),
        (
            "d3_state_tokens list with a bool element",
            "/classify",
            {**two, "d3_state_tokens": [state_tokens, True]},
        ),
        ("d3_state_tokens -3", "/classify", {**classify, "d3_state_tokens": -3}),
        (
            "d3_state_tokens oversized",
            "/classify",
            {**classify, "d3_state_tokens": len(prompt_ids) + 1},
        ),
        ("d3_state_tokens missing", "/classify", classify),
        (
            "over-long prompt",
            "/v1/systemone",
            {"state": "word " * (2 * max_model_len), "questions": q},
        ),
        (
            "unknown question type",
            "/v1/systemone",
            {"state": "x", "questions": {"q": {"type": "box"}}},
        ),
        (
            "malformed image",
            "/v1/systemone",
            {"state": "x", "questions": q, "images": ["data:image/png;base64,AAAA"]},
        ),
    ]


def server_flags(
    long: bool, engine_args: dict[str, Any], serve_args: list[str]
) -> list[str]:
    """``vllm serve``'s flags after the checkpoint: the long states' length,
    ``engine_args`` as flags, then ``serve_args`` as given."""
    flags = ["--max-model-len", str(LONG_MAX_MODEL_LEN)] if long else []
    flags += [
        part
        for key, value in engine_args.items()
        for part in (f"--{key.replace('_', '-')}", str(value))
    ]
    return flags + list(serve_args)


def run_http(
    checkpoint: str,
    sets: dict,
    work: Path,
    long: bool,
    engine_args: dict[str, Any],
    log_name: str = "serve.log",
    serve_args: list[str] | None = None,
    clients: bool = True,
) -> dict:
    """Every set over HTTP, then the /classify list form and the bad inputs;
    with ``clients``, also the typesafe-sdk's sets and the decompression
    bomb."""
    flags = server_flags(long, engine_args, serve_args or [])
    with Server(checkpoint, *flags, log_file=work / log_name) as server:
        up = server.wait()
        log(f"server up in {up:.0f}s")
        answers: dict[str, list[dict]] = {}
        latency: dict[str, list[float]] = {}
        for name, requests in sets.items():
            for request in requests:
                started = time.time()
                status, body = post(server.url + "/v1/systemone", request)
                latency.setdefault(name, []).append(time.time() - started)
                if status != 200:
                    raise RuntimeError(f"{name}: HTTP {status}: {body}")
                answers.setdefault(name, []).append(body)
            log(f"http: {name}")
        from vllm_d3.reference import ReferenceRuntime

        prompt = ReferenceRuntime(checkpoint).render(sets["text, 1 question"][0])[0]
        ids, state_tokens = prompt.token_ids, prompt.state_tokens
        max_len = served_max_model_len(server.url, timeout=10)
        status, reply = post(
            server.url + "/classify", classify_list_form(ids, state_tokens)
        )
        classify_list = {"status": status, "results": len(reply.get("data", []))}
        rejected = []
        for what, route, body in bad_inputs(ids, state_tokens, max_len):
            status, reply = post(server.url + route, body)
            rejected.append(
                {
                    "what": what,
                    "route": route,
                    "status": status,
                    "message": str(reply.get("error", reply))[:300],
                }
            )
        sdk, bomb = {}, None
        if clients:
            sdk = {
                n: sdk_answers(server.url, checkpoint, sets[n]) for n in sdk_sets(sets)
            }
            log(f"http: the typesafe-sdk on {', '.join(sdk)}")
            bomb = decompression_bomb_status(server.url)
        status, _ = post(server.url + "/v1/systemone", sets["text, 1 question"][0])
        return {
            "sdk_answers": sdk,
            "decompression_bomb": bomb,
            "answers": answers,
            "latency_s": latency,
            "server_up_s": up,
            "max_model_len": max_len,
            "max_model_len_flag": long,
            "classify_list": classify_list,
            "bad_inputs": rejected,
            "valid_after_bad_inputs": status,
        }


def same_questions(against: dict, got: dict) -> dict:
    """``against``'s responses cut to the questions ``got`` answers."""
    return {
        name: [
            {"answers": {qid: a["answers"][qid] for qid in g["answers"]}}
            for a, g in zip(against[name], got[name], strict=True)
        ]
        for name in got
    }


class _RouteAnswers(BaseModel):
    """A /v1/systemone response as the route writes it, read by the SDK."""

    answers: dict[str, dict[str, Any]]


def sdk_answers(url: str, model: str, requests: list[dict]) -> list[dict]:
    """The answers to ``requests`` (each a JSON request of text state and
    image data URLs) sent by the typesafe-sdk as published: zstd bodies from
    1 KiB, the images as multipart assets placed in the state. The SDK names a
    model in every request (its own default unless told), so it is given the
    served ``model``."""
    from typesafe_sdk import Image as Asset
    from typesafe_sdk import RetryPolicy, TypeSafeClient

    answers = []
    with TypeSafeClient(
        api_key="unused",
        base_url=url,
        model=model,
        retry=RetryPolicy(max_retries=0),
        timeout=600,
    ) as client:
        for request in requests:
            images = [
                Asset(base64.b64decode(data_url.split(",", 1)[1]))
                for data_url in request.get("images") or ()
            ]
            state = [*images, request["state"]] if images else request["state"]
            reply = client.system_one(
                state=state,
                questions=request["questions"],
                response_model=_RouteAnswers,
            )
            answers.append({"answers": reply.answers})
    return answers


def decompression_bomb_status(url: str) -> int:
    """The status of a zstd /v1/systemone body that decodes to ``BOMB_BYTES``."""
    from vllm_d3.entrypoints.serve.middleware.systemone_body import zstd

    compressor = zstd.ZstdCompressor()
    chunk = bytes(2**20)
    body = b"".join(compressor.compress(chunk) for _ in range(BOMB_BYTES // 2**20))
    request = urllib.request.Request(
        url + "/v1/systemone",
        body + compressor.flush(),
        {"Content-Type": "application/json", "Content-Encoding": "zstd"},
    )
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code


def sdk_sets(sets: dict[str, list[dict]]) -> list[str]:
    """The sets the SDK sends (it takes images, not videos): those of images
    beside a text state, and the other text set whose bodies are the longest
    (the long states in a full run)."""

    def text_state(name: str) -> bool:
        return all(
            isinstance(r["state"], str) and not r.get("videos") for r in sets[name]
        )

    text = [name for name in sets if text_state(name)]
    images = [n for n in text if all(r.get("images") for r in sets[n])]
    plain = [n for n in text if not any(r.get("images") for r in sets[n])]
    longest = max(plain, key=lambda n: max(len(json.dumps(r)) for r in sets[n]))
    return [*images, longest]


def chunked_prefill_refused(checkpoint: str, work: Path) -> dict:
    with Server(
        checkpoint, "--enable-chunked-prefill", log_file=work / "serve-cp.log"
    ) as server:
        refused = False
        try:
            server.wait(timeout=300)
        except ServerExited:
            refused = True
        except TimeoutError:
            pass
    text = server.log_file.read_text()
    return {
        "refused": refused,
        "message_present": "do not support chunked prefill" in text,
    }


# --------------------------------------------------------------------- report


def verdict_of(table: str) -> tuple[str, Callable[[dict], bool]]:
    """What a table's rows must show: a control clearly wrong; the two read
    paths within ``STATE_ONCE_TOLERANCE``; everything else ``passes``."""
    if table.startswith("control"):
        return "clearly wrong", clearly_wrong
    if table in (STATE_ONCE_TABLE, PACKED_TABLE):
        return "meets", functools.partial(passes, tolerance=STATE_ONCE_TOLERANCE)
    return "meets", passes


def _table(rows: list[tuple[str, dict]], table: str) -> list[str]:
    verdict, check = verdict_of(table)
    lines = [
        "| set | questions | decisions changed (near ties) | median abs dp | p90 "
        f"| max | {verdict} |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in rows:
        lines.append(
            f"| {name} | {s['questions']} | {s['decisions_changed']} "
            f"({s['changed_near_ties']}) "
            f"| {s['median_dp']:.4f} | {s['p90_dp']:.4f} | {s['max_dp']:.4f} "
            f"| {'yes' if check(s) else 'NO'} |"
        )
    return lines


def versions() -> dict[str, str]:
    """The run (date, commit, GPU) and the versions a measured run reports."""
    import torch
    import transformers
    import vllm

    return {
        **run_record(),
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


# The tables of a run: answers that must match the reference (``passes``),
# negative controls that must not (``clearly_wrong``), and the reference's own
# GPU-vs-CPU check.
HTTP_TABLE = "prefix_bidir, HTTP /v1/systemone"
#: The same requests sent by the typesafe-sdk (zstd bodies, image assets).
SDK_TABLE = "prefix_bidir, HTTP /v1/systemone from the typesafe-sdk"
#: Served answers, state read once, against the same engine's answers with one
#: request per question (``--additional-config '{"d3_state_once": false}'``).
STATE_ONCE_TABLE = "state once vs one request per question, HTTP"
PER_QUESTION_ARGS = {"additional_config": json.dumps({STATE_ONCE_KEY: False})}
INPROCESS_TABLE = "prefix_bidir, in process (LLM.classify)"
#: Every short text request packed (its state read once), all sent at once,
#: against the same engine's one prompt per question.
PACKED_TABLE = "state once, packed requests batched together, in process"
#: Packed with each second question's block joined to the one before.
MERGED_CONTROL = "control: packed, each second question reads the one before"
CAUSAL_CONTROL = "control: served vs reference causal mask"
BIDIR_CONTROL = "control: served vs reference whole-prompt bidirectional"
ONE_BLOCK_CONTROL = "control: state size withheld (one block), in process"
OTHER_MODE_TABLES = {mode: f"{mode} checkpoint, in process" for mode in OTHER_MODES}
SERVED_TABLES = (
    INPROCESS_TABLE,
    HTTP_TABLE,
    SDK_TABLE,
    *OTHER_MODE_TABLES.values(),
)
#: Controls of a mask; ``MERGED_CONTROL`` is one of the packing.
CONTROL_TABLES = (ONE_BLOCK_CONTROL, CAUSAL_CONTROL, BIDIR_CONTROL)
#: Every table a complete run produces, in the report's order.
EXPECTED_TABLES = (
    HTTP_TABLE,
    SDK_TABLE,
    STATE_ONCE_TABLE,
    CAUSAL_CONTROL,
    BIDIR_CONTROL,
    INPROCESS_TABLE,
    ONE_BLOCK_CONTROL,
    PACKED_TABLE,
    MERGED_CONTROL,
    *OTHER_MODE_TABLES.values(),
    GPU_CHECK_TABLE,
)


def report(results: dict, command: str, section: str | None = None) -> str:
    """``validation.md`` for one run; with ``section``, the same as a section of
    that title, to append to another run's page (each section names its run)."""
    head = "#" if section is None else "##"
    title = section or "Validation: vLLM + vllm-d3 against the reference runtime"
    lines = [f"{head} {title}", ""]
    if section is None:
        lines += [
            "Generated by `benchmarks.validation`, each section from the run its "
            "command names; do not edit by hand.",
            "",
        ]
    lines += [f"Command: `{command}`", ""]
    lines += [f"- {k}: {v}" for k, v in results["versions"].items()]
    lines += [
        "",
        f"Targets: max abs dp <= {TOLERANCE}; a decision may change only where the "
        f"reference's top two are within {TIE}. Negative controls must exceed "
        f"{CONTROL_MARGIN} x {TOLERANCE}. State once against one request per "
        f"question (the same engine): max abs dp <= {STATE_ONCE_TOLERANCE}.",
        "",
    ]
    if results.get("reference_cache"):
        lines += [
            "The reference's answers come from `--reference-cache`, each computed "
            "by an earlier run, maybe on another machine, for the same checkpoint "
            "files, requests, mask and device (`reference_key`).",
            "",
        ]
    for table, rows in results["tables"].items():
        lines += [f"{head}# {table}", "", *_table(list(rows.items()), table), ""]
    missing = [t for t in EXPECTED_TABLES if t not in results["tables"]]
    missing += [] if "chunked_prefill" in results else ["--enable-chunked-prefill"]
    if missing:
        lines += [
            f"{head}# Not measured in this run",
            "",
            *(f"- {t}" for t in missing),
            "",
        ]
    failures = results.get("failures", {})
    if failures:
        lines += [f"{head}# Failures", ""]
        lines += [f"- {title}: {error}" for title, error in failures.items()]
        lines += [""]
    batch = results.get("packed_batch")
    if batch:
        lines += [
            f"Packed in process: {batch['prompts']} requests of "
            f"{', '.join(map(str, batch['question_counts']))} questions, "
            f"{batch['tokens']} tokens in all, sent at once to an engine whose "
            f"step holds {batch['max_num_batched_tokens']} tokens.",
            "",
        ]
    http = results.get("http")
    if http:
        lines += _http_lines(http, head)
    if "chunked_prefill" in results:
        lines += [
            f"{head}# --enable-chunked-prefill",
            "",
            f"Refused at start-up: {results['chunked_prefill']}",
            "",
        ]
    return "\n".join(lines)


def _http_lines(http: dict, head: str) -> list[str]:
    """The report's part on the HTTP run's other checks: bad inputs, the list
    form, the decompression bomb, the served length, the start-up."""
    lines = [
        f"{head}# Bad input over HTTP",
        "",
        "| input | route | status |",
        "|---|---|---|",
    ]
    lines += [
        f"| {b['what']} | {b['route']} | {b['status']} |" for b in http["bad_inputs"]
    ]
    source = (
        "--max-model-len" if http["max_model_len_flag"] else "validated_length, no flag"
    )
    classify_list = http.get("classify_list")
    if classify_list:
        lines += [
            "",
            "`/classify` with two inputs and `d3_state_tokens` as a list: "
            f"HTTP {classify_list['status']}, "
            f"{classify_list['results']} results.",
        ]
    lines += [
        "",
        f"A zstd body that decodes to {BOMB_BYTES // 2**30} GiB: HTTP "
        f"{http['decompression_bomb']}.",
        f"A valid request after them: HTTP {http['valid_after_bad_inputs']}.",
        f"Served max_model_len: {http['max_model_len']} ({source}).",
        f"Server start-up: {http['server_up_s']:.0f} s.",
        "",
    ]
    return lines


def split_sets(
    sets: dict[str, list[dict]],
) -> tuple[dict[str, list[dict]], dict[str, list[dict]], dict[str, list[dict]]]:
    """The sets without images or videos, those of them without a long state,
    and every set without a long state."""
    text_sets = {
        k: v
        for k, v in sets.items()
        if not any(r.get("images") or r.get("videos") for r in v)
    }
    short_text = {k: v for k, v in text_sets.items() if not k.startswith(LONG_SETS)}
    short_sets = {k: v for k, v in sets.items() if not k.startswith(LONG_SETS)}
    return text_sets, short_text, short_sets


def reference_calls(
    checkpoints: dict[str, str], sets: dict[str, list[dict]]
) -> dict[str, tuple[str, dict[str, list[dict]], str | None, str]]:
    """Every reference a run may take, as ``reference_answers``' arguments. The
    oracle runs in float32 on the CPU, the same arithmetic whatever GPU runs
    the engines; only the long states need the GPU (and the GPU check)."""
    _, short_text, short_sets = split_sets(sets)
    main = checkpoints["prefix_bidir"]
    long_sets = {k: v for k, v in sets.items() if k not in short_sets}
    calls = {
        "prefix_bidir": (main, short_sets, None, "cpu"),
        "prefix_bidir, long states": (main, long_sets, None, "cuda"),
        "causal mask": (main, short_text, "causal", "cpu"),
        "noncausal_full_attention mask": (
            main,
            short_text,
            "noncausal_full_attention",
            "cpu",
        ),
        "prefix_bidir on the GPU": (main, short_text, None, "cuda"),
    }
    for mode in OTHER_MODES:
        calls[f"{mode} checkpoint"] = (checkpoints[mode], short_text, None, "cpu")
    return calls


def fill_reference_cache(work: Path, cache: Path, quick: bool) -> None:
    """Every reference a run of these settings takes, into ``cache``: those on
    the CPU here, and those on the GPU where this machine has one."""
    import torch

    checkpoints = build_checkpoints(work / "checkpoints")
    sets = scaled_sets(checkpoints["prefix_bidir"], quick=quick)
    for name, call in reference_calls(checkpoints, sets).items():
        if call[3] == "cpu" or torch.cuda.is_available():
            reference_answers(*call, cache=cache)
        else:
            log(f"reference {name}: left to a machine with a GPU")


def _compare_sets(against: dict, got: dict, names: Any) -> dict:
    """One table: each set of ``names``, ``got`` against ``against``."""
    return {n: compare(flatten(against[n]), flatten(got[n])) for n in names}


def _run_command(
    quick: bool,
    parallel: bool,
    dtype: str | None,
    serve_args: list[str],
    http_only: bool,
    reference_cache: bool,
    gdn_prefill_backend: str | None,
) -> str:
    """The command line a run's report names."""
    command = "python -m benchmarks.validation run --out OUT"
    command += " --quick" if quick else ""
    command += " --parallel" if parallel else ""
    command += f" --dtype {dtype}" if dtype else ""
    gdn = gdn_prefill_backend
    command += f" --gdn-prefill-backend {gdn}" if gdn else ""
    command += "".join(f" {shlex.quote(f'--serve-arg={arg}')}" for arg in serve_args)
    command += " --http-only" if http_only else ""
    return command + (" --reference-cache CACHE" if reference_cache else "")


def _engine_args(
    parallel: bool, dtype: str | None, gdn_prefill_backend: str | None
) -> dict[str, Any]:
    """The options a user would pass: in parallel, every engine gets a share of
    the GPU's memory and a fixed KV cache; ``dtype`` serves in another dtype,
    ``gdn_prefill_backend`` on another Gated DeltaNet prefill kernel."""
    engine_args: dict[str, Any] = {}
    if gdn_prefill_backend:
        engine_args["gdn_prefill_backend"] = gdn_prefill_backend
    if parallel:
        engine_args["gpu_memory_utilization"] = PARALLEL_MEMORY
        engine_args["kv_cache_memory_bytes"] = PARALLEL_KV_CACHE_BYTES
    if dtype:
        engine_args["dtype"] = dtype
    return engine_args


def _served_over_http(
    checkpoint: str,
    sets: dict,
    work: Path,
    long: bool,
    engine_args: dict[str, Any],
    serve_args: list[str],
    parallel: bool,
) -> tuple[dict, dict]:
    """``run_http`` on the default server and on one that reads one question
    per request; in parallel (each engine holds a share of the GPU) at once."""
    with ThreadPoolExecutor(2 if parallel else 1) as pool:
        served = pool.submit(
            run_http, checkpoint, sets, work, long, engine_args, "serve.log", serve_args
        )
        per_question = pool.submit(
            run_http,
            checkpoint,
            sets,
            work,
            long,
            {**engine_args, **PER_QUESTION_ARGS},
            "serve-per-question.log",
            serve_args,
            # The clients' bodies are decoded ahead of the read path.
            clients=False,
        )
        return served.result(), per_question.result()


def _add_http_tables(
    results: dict[str, Any],
    http: dict,
    per_question: dict,
    sets: dict,
    short_text: dict,
    ref_causal: dict,
    ref_bidir: dict,
) -> None:
    """The HTTP run's answers and tables into ``results`` (whose answers hold
    the reference's)."""
    answers, tables = results["answers"], results["tables"]
    ref = answers["reference"]
    results["http"] = {
        k: v for k, v in http.items() if k not in ("answers", "sdk_answers")
    }
    answers["http"] = http["answers"]
    answers["http, typesafe-sdk"] = http["sdk_answers"]
    tables[SDK_TABLE] = _compare_sets(ref, http["sdk_answers"], http["sdk_answers"])
    answers["http, one request per question"] = per_question["answers"]
    tables[HTTP_TABLE] = _compare_sets(ref, http["answers"], sets)
    tables[STATE_ONCE_TABLE] = _compare_sets(
        per_question["answers"], http["answers"], sets
    )
    tables[CAUSAL_CONTROL] = _compare_sets(ref_causal, http["answers"], short_text)
    tables[BIDIR_CONTROL] = _compare_sets(ref_bidir, http["answers"], short_text)


def _add_inprocess_tables(
    results: dict[str, Any], served: dict, text_sets: dict, short_text: dict
) -> None:
    """The in-process engine's answers and tables into ``results``."""
    answers, tables = results["answers"], results["tables"]
    ref = answers["reference"]
    answers["in process"] = served
    tables[INPROCESS_TABLE] = _compare_sets(ref, served["served"], text_sets)
    tables[ONE_BLOCK_CONTROL] = _compare_sets(ref, served["one block"], short_text)
    results["packed_batch"] = served["packed_batch"]
    tables[PACKED_TABLE] = _compare_sets(served["served"], served["packed"], short_text)
    merged = served["packed, pairs merged"]
    tables[MERGED_CONTROL] = _compare_sets(
        same_questions(served["served"], merged), merged, short_text
    )


def _add_mode_table(
    results: dict[str, Any], mode: str, job: InProcess, against: dict, names: dict
) -> None:
    """An other mode's engine table into ``results``; an engine that fails is
    recorded, and the run goes on to the remaining checks."""
    title = OTHER_MODE_TABLES[mode]
    try:
        served = results["answers"][f"{mode} in process"] = job.result()
    except RuntimeError as error:
        results.setdefault("failures", {})[title] = str(error)
        log(f"{title}: {error}")
    else:
        results["tables"][title] = _compare_sets(against, served["served"], names)


def run(
    out: Path,
    quick: bool,
    work: Path | None = None,
    parallel: bool = False,
    dtype: str | None = None,
    serve_args: list[str] | None = None,
    http_only: bool = False,
    reference_cache: Path | None = None,
    gdn_prefill_backend: str | None = None,
) -> dict:
    """The validation; ``serve_args`` go to both servers (e.g.
    ``--tensor-parallel-size 2``), ``http_only`` leaves out the in-process
    engines, the other modes' checkpoints and the start-up checks (for
    parallel modes that ``vllm.LLM`` does not run in one process), and
    ``reference_cache`` is where the reference's answers are kept between runs
    (``reference_answers``)."""
    serve_args = list(serve_args or [])
    out.mkdir(parents=True, exist_ok=True)
    work = work or out / "work"
    work.mkdir(parents=True, exist_ok=True)
    checkpoints = build_checkpoints(work / "checkpoints")
    main = checkpoints["prefix_bidir"]
    sets = scaled_sets(main, quick=quick)
    long = not quick
    text_sets, short_text, _ = split_sets(sets)
    log(f"sets: {', '.join(f'{k} ({len(v)})' for k, v in sets.items())}")
    oracle = reference_calls(checkpoints, sets)

    def reference(name: str) -> dict[str, list[dict]]:
        return reference_answers(*oracle[name], cache=reference_cache)

    ref = reference("prefix_bidir")
    ref.update(reference("prefix_bidir, long states") if long else {})
    ref_causal = reference("causal mask")
    ref_bidir = reference("noncausal_full_attention mask")
    results: dict[str, Any] = {"versions": versions(), "tables": {}}
    results["reference_cache"] = reference_cache is not None
    answers = results["answers"] = {"reference": ref}
    command = _run_command(
        quick,
        parallel,
        dtype,
        serve_args,
        http_only,
        reference_cache is not None,
        gdn_prefill_backend,
    )

    def save() -> None:
        (out / "results.json").write_text(json.dumps(results, indent=1))
        (out / "validation.md").write_text(report(results, command))

    engine_args = _engine_args(parallel, dtype, gdn_prefill_backend)

    def in_process(mode: str, names: dict) -> InProcess:
        long_states = any(n.startswith(LONG_SETS) for n in names)
        return InProcess(checkpoints[mode], names, work, mode, long_states, engine_args)

    main_job = None if http_only else in_process("prefix_bidir", text_sets)
    # In parallel the other modes' engines start now, beside the servers.
    at_once = OTHER_MODES if parallel and not http_only else ()
    jobs = {mode: in_process(mode, short_text) for mode in at_once}
    http, per_question = _served_over_http(
        main, sets, work, long, engine_args, serve_args, parallel
    )
    _add_http_tables(
        results, http, per_question, sets, short_text, ref_causal, ref_bidir
    )
    save()
    if main_job is None:
        return results
    _add_inprocess_tables(results, main_job.result(), text_sets, short_text)
    save()
    for mode in OTHER_MODES:
        job = jobs.get(mode) or in_process(mode, short_text)
        # The other modes' oracle, only where their engines run.
        ref_mode = reference(f"{mode} checkpoint")
        _add_mode_table(results, mode, job, ref_mode, short_text)
        save()
    results["chunked_prefill"] = chunked_prefill_refused(main, work)
    save()
    on_gpu = answers["reference on gpu"] = reference("prefix_bidir on the GPU")
    results["tables"][GPU_CHECK_TABLE] = _compare_sets(ref, on_gpu, short_text)
    save()
    return results


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _run_arguments(sub.add_parser("run"))
    cache_p = sub.add_parser(
        "references", help="fill a reference cache for a run of these settings"
    )
    cache_p.add_argument("--work", type=Path, required=True)
    cache_p.add_argument("--cache", type=Path, required=True)
    cache_p.add_argument("--quick", action="store_true")
    report_p = sub.add_parser("report", help="write validation.md from results.json")
    report_p.add_argument("results", type=Path)
    report_p.add_argument("--run-command", required=True, help="the run's command")
    report_p.add_argument("--out", type=Path, required=True)
    report_p.add_argument(
        "--append",
        metavar="TITLE",
        help="append the run to OUT as a section of this title",
    )
    ref_p = sub.add_parser(
        "reference", help="the reference's answers on the CPU, as JSON"
    )
    ref_p.add_argument("checkpoint")
    ref_p.add_argument("sets_file", type=Path)
    ref_p.add_argument("out_file", type=Path)
    ref_p.add_argument("--attention", help="a mask other than the checkpoint's")
    ip = sub.add_parser("inprocess")
    ip.add_argument("checkpoint")
    ip.add_argument("sets_file")
    ip.add_argument("out_file")
    ip.add_argument("--long", action="store_true")
    ip.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        help="KEY=JSON, an LLM keyword argument",
    )
    return parser


def _run_arguments(run_p: argparse.ArgumentParser) -> None:
    run_p.add_argument("--out", type=Path, required=True)
    run_p.add_argument(
        "--quick", action="store_true", help="one request per set, no long states"
    )
    run_p.add_argument(
        "--work", type=Path, help="checkpoints and logs (default OUT/work)"
    )
    run_p.add_argument(
        "--dtype", help="serve in this dtype (e.g. float32) instead of the model's"
    )
    run_p.add_argument(
        "--parallel",
        action="store_true",
        help="run the vLLM engines at once, each with "
        f"{PARALLEL_MEMORY * 100:.0f}%% of the GPU memory",
    )
    run_p.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help="a flag for both vllm serve commands, as one argument "
        "(--serve-arg=--tensor-parallel-size=2)",
    )
    run_p.add_argument(
        "--gdn-prefill-backend",
        help="serve on this Gated DeltaNet prefill kernel (e.g. triton) instead "
        "of the one vLLM and the plugin choose",
    )
    run_p.add_argument(
        "--http-only",
        action="store_true",
        help="only the servers: no in-process engines, other modes or start-up checks",
    )
    run_p.add_argument(
        "--reference-cache",
        type=Path,
        help="read the reference's answers from here, and keep new ones here",
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "reference":
        # Before anything imports transformers' Qwen3.5 modelling code: a None
        # entry in sys.modules makes an import of that package fail.
        for package in GPU_ONLY_KERNEL_PACKAGES:
            sys.modules[package] = None  # type: ignore[assignment]
        sets = json.loads(args.sets_file.read_text())
        answers = _reference_answers_here(args.checkpoint, sets, args.attention, "cpu")
        args.out_file.write_text(json.dumps(answers))
    elif args.command == "report":
        results = json.loads(args.results.read_text())
        if args.append:
            page = args.out.read_text().rstrip("\n")
            section = report(results, args.run_command, args.append)
            args.out.write_text(f"{page}\n\n{section}")
        else:
            args.out.write_text(report(results, args.run_command))
    elif args.command == "inprocess":
        engine_args = dict(arg.split("=", 1) for arg in args.engine_arg)
        run_inprocess(
            args.checkpoint,
            args.sets_file,
            args.out_file,
            args.long,
            {key: json.loads(value) for key, value in engine_args.items()},
        )
    elif args.command == "references":
        fill_reference_cache(args.work, args.cache, args.quick)
    else:
        run(
            args.out,
            args.quick,
            args.work,
            args.parallel,
            args.dtype,
            args.serve_arg,
            args.http_only,
            args.reference_cache,
            args.gdn_prefill_backend,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
