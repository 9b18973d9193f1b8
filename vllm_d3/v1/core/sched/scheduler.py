# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Scheduling prefix_bidir requests with prefix caching on
(upstream: ``v1/core/sched/scheduler.py``, an edit of four of its methods:
the series' state cache commit, ``vllm_d3.export.series``).

Prefix caching of a hybrid model needs chunked prefill and Mamba "align" mode,
whose scheduler cuts a prompt where the token budget, a block boundary or an
encoder cap ends. A prefix_bidir prompt's state and question blocks read
themselves both ways, so it is scheduled whole or waits: ``D3Scheduler``
(and ``D3AsyncScheduler``, for async scheduling) keeps each request that
carries a state block size from being cut, bounds its prefix-cache hit
inside its state and queues a request whose state is cached ahead of those
that would read theirs (``d3_state_cache``). Requests without one are
scheduled as vLLM does. The plugin's config hook selects them where prefix
caching is on; in-tree vLLM's own schedulers have the edit.
"""

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from vllm_d3.v1.core.d3_state_cache import (
    bounded_hit,
    cached_states_first,
    request_state_tokens,
    whole_or_waits,
)


class D3Scheduler(Scheduler):
    def add_request(self, request: Request) -> None:
        super().add_request(request)
        cached_states_first(
            self.waiting, request, self.kv_cache_manager, self.max_num_scheduled_tokens
        )

    def _get_local_prefix_cache_hit(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int, bool]:
        return super()._get_local_prefix_cache_hit(
            request, bounded_hit(request, max_cache_hit_length)
        )

    def _mamba_block_aligned_split(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_local_computed_tokens: int = 0,
        num_external_computed_tokens: int = 0,
    ) -> int:
        if request_state_tokens(request) is not None:
            # Not at block boundaries: the Gated DeltaNet state the cache
            # needs is the one at the state block's last cacheable boundary,
            # taken inside the step (docs/design.md, "The state cache").
            return num_new_tokens
        return super()._mamba_block_aligned_split(
            request,
            num_new_tokens,
            num_new_local_computed_tokens,
            num_external_computed_tokens,
        )

    def _reserve_prefill_lookahead(
        self, request: Request, num_computed_tokens: int, num_new_tokens: int
    ) -> int:
        # The last cut of a step's tokens before they are scheduled.
        num_new_tokens = super()._reserve_prefill_lookahead(
            request, num_computed_tokens, num_new_tokens
        )
        return whole_or_waits(request, num_computed_tokens, num_new_tokens)


class D3AsyncScheduler(D3Scheduler, AsyncScheduler):
    pass
