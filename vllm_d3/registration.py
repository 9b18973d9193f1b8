"""What ``vllm_d3.register`` installed in this process, and whether vLLM's
``CUSTOM`` attention backend is the plugin's: the record the config hook reads,
apart from the code that writes it, so that neither imports the other."""

#: The dense-piece attention backend, registered as vLLM's ``CUSTOM`` backend.
DENSE_ATTENTION_BACKEND = (
    "vllm_d3.v1.attention.backends.d3_prefix_bidir.D3PrefixBidirAttentionBackend"
)
#: Appended to by ``vllm_d3.register`` only.
installed: list[str] = []


def installed_hooks() -> list[str]:
    """What ``register`` installed in this process (empty before it ran)."""
    return list(installed)


def owns_custom_backend() -> bool:
    """Whether vLLM's ``CUSTOM`` attention backend is the dense-piece one."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    custom = AttentionBackendEnum.CUSTOM
    return custom.is_overridden() and custom.get_path() == DENSE_ATTENTION_BACKEND
