"""vLLM's own Gated DeltaNet kernels on the CPU, through Triton's interpreter.

vLLM 0.33.0's ``QwenGatedDeltaNetAttention._forward_core`` runs Triton kernels:
the post-convolution preparation and FLA's chunked delta rule. Triton's
interpreter runs them on CPU tensors in NumPy, which lets a CPU test put the
packed phases through the real layer rather than a stand-in. The causal
convolution runs vLLM's CPU implementation, which its module puts in place of
the Triton one on a machine without a GPU (whose launch grid does not run in
the interpreter); the layouts the layer hands it are recorded
(``convolution_layouts``). The layer runs in float16, the tiny checkpoint's
dtype: the interpreter's bfloat16 gives wrong results on FLA's kernels.

The interpreter must be chosen before the kernels are decorated, and vLLM keeps
Triton on a machine with no GPU driver only when ``CUDA_VISIBLE_DEVICES`` is set
and empty (``vllm/triton_utils/importing.py``), so the run has a process of its
own, with ``ENVIRONMENT``:

    python -m vllm_d3.testing.gdn_kernels CHECKPOINT CASES OUT

``CASES`` is a ``torch.save`` of a list of ``Case`` dicts; ``OUT`` gets, for
each, the layer's output, its state caches before and after the step, the
form its Gated DeltaNet ran in, the kernel configurations it was the first
case to autotune and the layouts its causal convolution got (``run_case``).
Each case builds the model state of ``vllm serve CHECKPOINT`` on the CPU,
schedules ``step`` (``(req_id, prompt_len, extra, slot)`` per row, whole
prompts; ``checkpoints``, if given, as ``model_runner.GivenCheckpoints``
places them; ``align_block``, if given, in align mode on blocks of that many
tokens, each row's slot its Gated DeltaNet block table; ``computed``, if
given, after that many tokens of a request found in the prefix cache) through
its ``prepare_attn``, and runs one Gated DeltaNet layer's
``_forward_core`` on ``inputs`` (``mixed_qkv``, ``b``, ``a``). The layer's
parameters and its state caches (which a fresh prefill must not read) are drawn
from fixed seeds, the same in every case, or (``cache_from``) taken from the
state caches an earlier case left. ``restart=False`` calls 0.33.0's method
itself, not the plugin's (``qwen_gdn_linear_attn.py``). The state caches are
laid out as vLLM lays them out, each slot at the start of a larger page
(``paged``), or (``packed_cache``) one slot after the other.

``use_interpreter()`` makes four differences between the interpreter and a GPU
harmless; each names what it depends on:

- vLLM stages host-to-device copies in pinned memory, which needs a GPU driver
  (``vllm.utils.torch_utils.PIN_MEMORY``);
- Triton's autotuner times its configurations, which needs one too: each is
  taken as equally fast, so the first is used
  (``triton.runtime.autotuner.Autotuner._bench``);
- a kernel that calls a ``triton.language`` builtin through an alias (FLA's
  ``exp = tl.exp`` in ``ops/op.py``) would call it unpatched: the alias calls
  the builtin by name, which the interpreter patches while a kernel runs;
- ``range`` in a kernel must yield interpreter tensors (FLA's
  ``chunk_delta_h.py`` calls ``i_t.to(tl.int64)``): while a kernel runs, the
  modules that hold kernels see one that does (added to the scope of
  ``triton.runtime.interpreter._patch_lang``, which restores it after the
  kernel, each index made a tensor by its ``_implicit_cvt``).
"""

import builtins
import contextlib
import os
import sys
import types
from collections.abc import Iterator
from typing import Any, NotRequired, TypedDict

import torch

#: What the process needs before it imports vLLM.
ENVIRONMENT = {
    "CUDA_VISIBLE_DEVICES": "",
    "TRITON_INTERPRET": "1",
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_USE_V2_MODEL_RUNNER": "1",
}

#: The seeds of the layer's parameters and of its state caches.
PARAMETER_SEED, CACHE_SEED = 1, 2
#: State slots of the cache the layer gets (each row names its own).
CACHE_SLOTS = 16
#: vLLM gives each slot of a layer's state caches one page, which holds the
#: convolution state and the recurrent one, so either's slots are further apart
#: than their size. A page here is twice a slot.
PAGE_SLOTS = 2


class Case(TypedDict):
    step: list[tuple[str, int, dict[str, Any], int]]
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    restart: bool
    questions_per_scan: int
    state_reread_tokens_max: int
    split_sequences_max: int
    checkpoints: NotRequired[dict[int, tuple[int, int]]]
    packed_cache: NotRequired[bool]
    align_block: NotRequired[int]
    computed: NotRequired[dict[str, int]]
    cache_from: NotRequired[int]


def use_interpreter() -> None:
    """Let vLLM's Triton kernels run in the interpreter (module docstring)."""
    import triton.language as tl
    import vllm.utils.torch_utils
    from triton.runtime import autotuner, interpreter

    vllm.utils.torch_utils.PIN_MEMORY = False
    # Autotuner._bench(self, *args, config, **meta) -> [median, p20, p80] in ms.
    autotuner.Autotuner._bench = lambda self, *args, config, **meta: [0.0] * 3  # type: ignore[method-assign]

    builtin_homes: dict[int, tuple[types.ModuleType, str]] = {}
    for home in (tl, tl.math, tl.core):
        for name, member in vars(home).items():
            if isinstance(member, types.FunctionType) and tl.core.is_builtin(member):
                builtin_homes.setdefault(id(member), (home, name))

    def by_name(home: types.ModuleType, name: str):
        return lambda *args, **kwargs: getattr(home, name)(*args, **kwargs)

    kernel_modules = [
        module
        for module_name, module in list(sys.modules.items())
        if module_name.startswith("vllm.") and vars(module).get("tl") is tl
    ]
    for module in kernel_modules:
        for name, member in list(vars(module).items()):
            if id(member) in builtin_homes and isinstance(member, types.FunctionType):
                setattr(module, name, by_name(*builtin_homes[id(member)]))

    def tensor_range(*bounds: Any) -> Iterator[Any]:
        for index in builtins.range(*(int(bound) for bound in bounds)):
            yield interpreter._implicit_cvt(index)

    class ModuleGlobals:
        """A module's namespace as an object, for the interpreter's scope."""

        def __init__(self, module: types.ModuleType) -> None:
            object.__setattr__(self, "namespace", vars(module))

        def __getattr__(self, name: str) -> Any:
            try:
                return self.namespace[name]
            except KeyError:
                raise AttributeError(name) from None

        def __setattr__(self, name: str, value: Any) -> None:
            self.namespace[name] = value

        def __delattr__(self, name: str) -> None:
            del self.namespace[name]

    # interpreter._patch_lang(fn) -> a scope whose restore() undoes its patches
    # once the kernel has run.
    patch_lang = interpreter._patch_lang

    def patch_lang_and_range(fn):
        scope = patch_lang(fn)
        for module in kernel_modules:
            scope.set_attr(ModuleGlobals(module), "range", tensor_range)
        return scope

    interpreter._patch_lang = patch_lang_and_range


def autotuned() -> set[str]:
    """Every kernel configuration Triton's autotuner has chosen in this
    process, as ``"kernel: key"`` (the key: the autotuner's key arguments and
    its arguments' dtypes)."""
    import triton.language as tl
    from triton.runtime.autotuner import Autotuner, Heuristics

    tuners = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("vllm.") or vars(module).get("tl") is not tl:
            continue
        for member in list(vars(module).values()):
            # Heuristics wrap the autotuner, which wraps the kernel.
            while isinstance(member, Heuristics):
                member = member.fn
            if isinstance(member, Autotuner):
                tuners[id(member)] = member
    return {
        f"{tuner.base_fn.__name__}: {key}"
        for tuner in tuners.values()
        for key in tuner.cache
    }


def paged(states: torch.Tensor) -> torch.Tensor:
    """``states`` with each slot at the start of a page ``PAGE_SLOTS`` times
    its size, as vLLM lays a layer's state caches out."""
    size = states[0].numel()
    pages = states.new_zeros((len(states), PAGE_SLOTS * size))
    slots = pages[:, :size].view(states.shape)
    slots.copy_(states)
    return slots


@contextlib.contextmanager
def convolution_layouts() -> Iterator[set[tuple[Any, ...]]]:
    """The layouts the layer's causal convolution gets while the block runs:
    what 0.33.0's Triton wrapper (``causal_conv1d_fn``) makes compile-time
    constants of or specializes its kernel on (the inputs' and the state
    cache's strides, the cache's dtype and whether it has one slot, the slot
    indices' stride), so that a layout of its own compiles a kernel of its
    own. On the CPU the wrapper is vLLM's CPU implementation, which these do
    not change."""
    from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn

    convolution = qwen_gdn_linear_attn.causal_conv1d_fn
    layouts: set[tuple[Any, ...]] = set()

    def recorded(x, weight, bias, *, conv_states, cache_indices, **kwargs):
        layouts.add(
            (
                x.stride(),
                conv_states.stride(),
                str(conv_states.dtype),
                len(conv_states) == 1,
                cache_indices.stride(0),
            )
        )
        return convolution(
            x,
            weight,
            bias,
            conv_states=conv_states,
            cache_indices=cache_indices,
            **kwargs,
        )

    qwen_gdn_linear_attn.causal_conv1d_fn = recorded  # type: ignore[assignment]
    try:
        yield layouts
    finally:
        qwen_gdn_linear_attn.causal_conv1d_fn = convolution


def run_case(
    checkpoint: str, case: Case, earlier: list[dict[str, Any]]
) -> dict[str, Any]:
    """The layer's output over ``case`` (``out``), its caches before and after
    it (``conv_before``, ``ssm_before``, ``conv_after``, ``ssm_after``; before:
    ``earlier[cache_from]``'s after, where given), the
    form the step ran in (``form``: ``FORMS``) and the kernel configurations
    it autotuned that no earlier case had (``tuned``) and the layouts its
    causal convolution got (``convolution_layouts``)."""
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        QwenGatedDeltaNetAttention,
    )

    from vllm_d3.testing.model_runner import (
        cpu_model_state,
        step_metadata,
    )
    from vllm_d3.v1.attention.backends import d3_packed_gdn
    from vllm_d3.v1.worker.gpu.model_states.d3_prefix_bidir import (
        D3PrefixBidirModelState,
    )

    d3_packed_gdn.QUESTIONS_PER_SCAN = case["questions_per_scan"]
    d3_packed_gdn.STATE_REREAD_TOKENS_MAX = case["state_reread_tokens_max"]
    d3_packed_gdn.SPLIT_SEQUENCES_MAX = case["split_sequences_max"]
    with cpu_model_state(
        D3PrefixBidirModelState, checkpoint, case.get("align_block")
    ) as state:
        _, config = state
        _, metadata, gdn = step_metadata(
            state,
            case["step"],
            checkpoints=case.get("checkpoints"),
            computed=case.get("computed"),
        )
        layer = config.compilation_config.static_forward_context[gdn[0]]
        assert isinstance(layer, QwenGatedDeltaNetAttention)
        generator = torch.Generator().manual_seed(PARAMETER_SEED)
        with torch.no_grad():
            for parameter in layer.parameters():
                drawn = torch.randn(parameter.shape, generator=generator)
                parameter.copy_(0.5 * drawn)
        generator.manual_seed(CACHE_SEED)
        before = [
            torch.randn(CACHE_SLOTS, *shape, generator=generator).to(dtype)
            for shape, dtype in zip(
                layer.get_state_shape(), layer.get_state_dtype(), strict=True
            )
        ]
        if "cache_from" in case:
            start = earlier[case["cache_from"]]
            before = [start["conv_after"], start["ssm_after"]]
        lay_out = torch.clone if case.get("packed_cache") else paged
        layer.kv_cache = tuple(lay_out(cache) for cache in before)
        mixed_qkv, b, a = case["inputs"]
        out = torch.full(
            (len(mixed_qkv), layer.num_v_heads, layer.head_v_dim),
            float("nan"),
            dtype=mixed_qkv.dtype,
        )
        core = (
            layer._forward_core
            if case["restart"]
            else types.MethodType(QwenGatedDeltaNetAttention._forward_core, layer)
        )
        tuned_before = autotuned()
        with (
            set_forward_context({gdn[0]: metadata}, config),
            convolution_layouts() as layouts,
        ):
            core(mixed_qkv, b, a, out)
        conv_after, ssm_after = layer.kv_cache
        conv_before, ssm_before = before
        return {
            "form": form_of(metadata),
            "tuned": sorted(autotuned() - tuned_before),
            "convolution_layouts": layouts,
            "out": out,
            "conv_before": conv_before,
            "ssm_before": ssm_before,
            "conv_after": conv_after,
            "ssm_after": ssm_after,
        }


#: How a step's Gated DeltaNet ran, by the metadata its layers got.
FORMS = ("one pass", "two phases", "one scan", "unpacked")


def form_of(metadata: object) -> str:
    from vllm_d3.v1.attention.backends.d3_packed_gdn import (
        PackedGDNAttentionMetadata,
        SplitGDNAttentionMetadata,
    )

    if isinstance(metadata, SplitGDNAttentionMetadata):
        return FORMS[0]
    if isinstance(metadata, PackedGDNAttentionMetadata):
        return FORMS[1] if metadata.phase_a is not None else FORMS[2]
    return FORMS[3]


def main(argv: list[str]) -> None:
    checkpoint, cases_path, out_path = argv
    assert all(os.environ.get(k) == v for k, v in ENVIRONMENT.items()), ENVIRONMENT
    # The layer's module imports the kernels it runs.
    import vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn  # noqa: F401

    from vllm_d3.testing.model_runner import single_process_group

    use_interpreter()
    cases: list[Case] = torch.load(cases_path)
    results: list[dict[str, Any]] = []
    with single_process_group():
        for case in cases:
            results.append(run_case(checkpoint, case, results))
    torch.save(results, out_path)


if __name__ == "__main__":
    main(sys.argv[1:])
