"""A trace's `config`: the manager a trace runs on, as both targets build it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from kvgate.errors import KvgateError

GroupKind = Literal["full_attention", "mamba_align"]
GROUP_KINDS: tuple[GroupKind, ...] = get_args(GroupKind)
# vLLM 0.33.0's `MambaCacheMode`: the modes its CacheConfig accepts.
MambaCacheMode = Literal["align", "none"]
MAMBA_CACHE_MODES: tuple[MambaCacheMode, ...] = get_args(MambaCacheMode)
# vLLM's `kv_load_failure_policy` values (KVTransferConfig): `recompute`
# (its default) recomputes what a failed load lost; `fail` ends the request.
KvLoadFailurePolicy = Literal["recompute", "fail"]
KV_LOAD_FAILURE_POLICIES: tuple[KvLoadFailurePolicy, ...] = get_args(KvLoadFailurePolicy)
# The model runner vLLM's engine hands scheduled work to: `v1`, or `v2`
# (vLLM's default on a GPU with Triton, `VLLM_USE_V2_MODEL_RUNNER`).
ModelRunner = Literal["v1", "v2"]
MODEL_RUNNERS: tuple[ModelRunner, ...] = get_args(ModelRunner)
# vLLM's scheduling policies (`SchedulerConfig.policy`): `fcfs` (its default)
# admits in arrival order and preempts the last running request; `priority`
# orders both by each request's (priority, arrival), the lowest value first.
SchedulingPolicy = Literal["fcfs", "priority"]
SCHEDULING_POLICIES: tuple[SchedulingPolicy, ...] = get_args(SchedulingPolicy)
# How the model behaves at the known vLLM defects (docs/findings.md):
# `follow` as vLLM 0.33.0 does, `fixed` as a vLLM that fixed them would.
VllmDefects = Literal["follow", "fixed"]
VLLM_DEFECT_ARMS: tuple[VllmDefects, ...] = get_args(VllmDefects)


@dataclass(frozen=True)
class GroupConfig:
    kind: GroupKind
    block_size: int
    speculative_blocks: int = 0
    # `MambaSpec.num_prefill_checkpoint_blocks` / `prefill_checkpoint_alignment`:
    # a spare block the backend exports a prefill's reusable state into from
    # inside the chunk (Mamba2 kernels, GDN on FlashInfer), so the scheduler
    # need not end a chunk there. None: the backend cannot export (never taken).
    prefill_checkpoint_blocks: int = 0
    prefill_checkpoint_alignment: int | None = None


@dataclass(frozen=True)
class Config:
    """A trace's config; `schema.CONFIG_FIELDS` maps each trace field onto an
    attribute (and states its default, vLLM setting and documentation)."""

    num_blocks: int
    hash_unit: int
    groups: tuple[GroupConfig, ...]
    eagle: bool
    retention_interval: int | None
    # The partial-tail hold (the seed's patch), trace field `retain_checkpoint`.
    hold: bool
    scheduler_block_size: int
    max_model_len: int = 8192
    max_num_scheduled_tokens: int = 8192
    # The production fork's retention of retired states (before and with its
    # patch 0093, under the same switch as the hold): the newest keyed Mamba
    # state that leaves a request's table stays held by the request. Trace
    # field `retain_retired`.
    retain_retired: bool = False
    # The scheduler's `long_prefill_token_threshold` (0: no cap): a prefill
    # chunk's cap while another request waits or runs, and the width the
    # align-mode split may run sub-block below (see `allocate`'s `auto`).
    long_prefill_token_threshold: int = 0
    # The scheduler's `long_prefill_token_threshold_adaptive`: the cap is
    # floored at a fair share of the token budget, max_num_scheduled_tokens
    # divided by the requests it holds.
    long_prefill_token_threshold_adaptive: bool = False
    # `enable_mamba_shared_prefix_checkpoint`: also key a Mamba state at the
    # shared-prefix junction a lookup reported (effective only with eagle and
    # sub-block hits, as vLLM narrows it).
    shared_prefix_checkpoint: bool = False
    # vLLM's enable_kv_cache_events: the pool queues BlockStored /
    # BlockRemoved / AllBlocksCleared events for the `events` op.
    kv_events: bool = False
    # Every request asks for `kv_cache_report_mode: full`: a lookup's hit is
    # reported as BlockStored events too (for a consumer that joined late).
    kv_events_full: bool = False
    # The scheduler's `scheduler_reserve_full_isl` (vLLM's default: on): a
    # request is admitted only if its whole sequence fits the free blocks
    # (`allocate_slots(full_sequence_must_fit=True)` on admission).
    reserve_full_sequence: bool = False
    # vLLM's `--disable-log-stats`: the manager keeps no prefix-cache stats
    # (`log_stats=False`), so `stats` reports none.
    disable_log_stats: bool = False
    # vLLM's `num_hash_lookahead_tokens` (trace field `hash_lookahead_tokens`),
    # eagle only: each block's hash also covers the next L tokens (the drafter's
    # KV at the block's last position reads them), so a block is keyed only once
    # they exist, and the trailing-block drop is off. vLLM's default for an
    # EAGLE-family drafter (L = 1 for EAGLE and single-module MTP; L = K for
    # a multi-module MTP drafter of K draft tokens, whose modules read K
    # prefill tokens ahead); 0 is its `disable_lookahead_block_hashes`
    # fallback, the drop.
    hash_lookahead_tokens: int = 0
    # vLLM's `enable_prefix_caching` (trace field `prefix_caching`): off, no
    # request is hashed, no lookup hits and no block is cached (vLLM's
    # no-prefix-cache coordinator); the hold has nothing to hold.
    prefix_caching: bool = True
    # vLLM's `mamba_cache_mode` for every Mamba group (trace field
    # `mamba_cache_mode`): `align` keeps states at block boundaries for prefix
    # caching; `none` (what the engine config sets without prefix caching)
    # gives a request one running state block plus its speculative blocks,
    # sized like attention's and freed below the last computed token.
    mamba_cache_mode: MambaCacheMode = "align"
    # The Scheduler has a KV connector (trace field `kv_connector`): each
    # lookup runs its connector branch of admission (external tokens,
    # truncation of a local sub-block tail, async loads).
    kv_connector: bool = False
    # The connector's `supports_divergent_local_hybrid_hits` (NIXL, MoRIIO;
    # trace field `kv_connector_divergent_hits`): the local lookup is
    # `get_computed_blocks_for_connector`, per-group hits.
    kv_connector_divergent_hits: bool = False
    # The connector's `kv_load_failure_policy` (trace field of that name):
    # `recompute` retries or truncates a failed load, `fail` fails the
    # request (and evicts a failed sync load's blocks from the prefix cache).
    kv_load_failure_policy: KvLoadFailurePolicy = "recompute"
    # vLLM's async scheduling (`--async-scheduling`; trace field of that
    # name, scheduler-level traces): the engine schedules a batch while the
    # last one runs, two batches in flight; with a consumer KV connector the
    # Scheduler then defers freeing blocks a batch in flight may still write.
    async_scheduling: bool = False
    # vLLM's `--kv-cache-metrics` (ObservabilityConfig.kv_cache_metrics): the
    # pool reports block residencies to a metrics collector, whose eviction
    # events the `residency` op drains; and its sample rate
    # (`kv_cache_metrics_sample`; vLLM's default 0.01, the trace's 1.0: only
    # 1.0, every block, is modelled, a lower rate samples at random).
    kv_cache_metrics: bool = False
    kv_cache_metrics_sample: float = 1.0
    # The engine's model runner (trace field `model_runner`): what the
    # Scheduler hands the worker differs (under `v2` a resumed request goes
    # out as a new one, and it tracks each request's encoder inputs); the
    # KV-cache manager's calls do not, so the model plays both alike.
    model_runner: ModelRunner = "v1"
    # The Scheduler's prefill cadence (`prefill_schedule_interval`, applied
    # locally without data parallelism): while a request decodes, prefill
    # compute waits until this many executed steps have passed since the last
    # step that carried prefill, unless the last release could not drain the
    # waiting queue. 1: no cadence.
    prefill_schedule_interval: int = 1
    # The Scheduler's policy (trace field `scheduling_policy`, scheduler-level
    # traces): under `priority` the waiting queue is ordered by each
    # request's (priority, arrival) and a failed allocation preempts the
    # running request that comes last in that order.
    scheduling_policy: SchedulingPolicy = "fcfs"
    # The model's arm at the known vLLM defects (trace field `vllm_defects`):
    # `follow` behaves as vLLM 0.33.0 does there, `fixed` as a vLLM that
    # fixed them would (docs/findings.md gives each fixed behaviour).
    vllm_defects: VllmDefects = "follow"
    # The engine's LoRA adapter limit (trace field `max_loras`, vLLM's
    # `LoRAConfig.max_loras`; scheduler-level traces): the Scheduler admits a
    # waiting request with an adapter only while the running requests hold
    # fewer adapters than this, or already hold its own. 0: the engine has no
    # LoRA config (and takes no request with an adapter).
    max_loras: int = 0
    # The Scheduler's encoder compute budget and encoder cache size, in
    # encoder embeddings (vLLM's `max_num_encoder_input_tokens` and
    # `encoder_cache_size`, which a multimodal model's budget derives from
    # `max_num_encoder_input_tokens` and `encoder_cache_size` in its
    # scheduler config). 0: the token budget, as vLLM's defaults are.
    encoder_compute_budget: int = 0
    encoder_cache_size: int = 0

    @property
    def encoder_budget(self) -> int:
        """The encoder embeddings one step may compute."""
        return self.encoder_compute_budget or self.max_num_scheduled_tokens

    @property
    def encoder_cache_slots(self) -> int:
        """The encoder embeddings the encoder cache holds."""
        return self.encoder_cache_size or self.max_num_scheduled_tokens

    @property
    def block_drop(self) -> bool:
        """The eagle trailing-block drop: eagle with legacy (no lookahead) hashes."""
        return self.eagle and self.hash_lookahead_tokens == 0

    @property
    def prefill_lookahead(self) -> int:
        """vLLM's `num_prefill_lookahead_tokens`: the prefill tokens past a
        chunk the drafter reads. 0 without a drafter; K for a multi-module
        MTP drafter (lookahead hashes of K > 1 tokens); 1 for any other
        EAGLE-family drafter."""
        if not self.eagle:
            return 0
        return max(1, self.hash_lookahead_tokens)

    @property
    def reprefillable_tokens(self) -> int:
        """The trailing computed tokens a multi-module MTP drafter may
        prefill again (vLLM's coordinator `num_reprefillable_tokens`): K - 1."""
        return max(0, self.prefill_lookahead - 1)

    @property
    def eagle_group_ids(self) -> tuple[int, ...]:
        """The groups vLLM flags as the drafter's (`is_eagle_group`), as its
        engine planning derives them: the groups holding a draft layer. An
        EAGLE/MTP drafter's layers are attention layers whose spec equals the
        target's attention spec (`is_draft` is left out of spec equality), so
        they join the attention groups; a Mamba group never holds one. Without
        an attention group nothing is flagged and, with the drop on, the
        coordinator's fallback flags every group. Lookahead hashes leave the
        flags and turn the drop off (`drop_group_ids`)."""
        if self.eagle and self.has_attention:
            return tuple(i for i, g in enumerate(self.groups) if g.kind == "full_attention")
        return tuple(range(len(self.groups))) if self.block_drop else ()

    @property
    def drop_group_ids(self) -> tuple[int, ...]:
        """The groups that take the trailing-block drop (vLLM's
        `drop_eagle_group_ids`): the flagged ones, while the drop is on."""
        return self.eagle_group_ids if self.block_drop else ()

    @property
    def has_attention(self) -> bool:
        """A hybrid; without it, a pure Mamba model (one group, vLLM's
        unitary coordinator)."""
        return any(g.kind == "full_attention" for g in self.groups)

    @property
    def mamba_group_ids(self) -> tuple[int, ...]:
        return tuple(i for i, g in enumerate(self.groups) if g.kind == "mamba_align")

    @property
    def mamba_align_split(self) -> bool:
        """The scheduler splits prefill chunks for Mamba (align mode only:
        in mode none no state is kept at a boundary)."""
        return self.mamba_cache_mode == "align"

    @property
    def prefill_checkpoints(self) -> bool:
        """The scheduler may rely on internal checkpoints: every Mamba group
        has a prefill checkpoint block (vLLM's `all`), alignment from the first."""
        return all(self.groups[i].prefill_checkpoint_blocks > 0 for i in self.mamba_group_ids)

    @property
    def prefill_checkpoint_alignment(self) -> int | None:
        ids = self.mamba_group_ids
        return self.groups[ids[0]].prefill_checkpoint_alignment if ids else None

    @property
    def shared_prefix_checkpoint_on(self) -> bool:
        """The knob as vLLM's `KVCacheManager` narrows it: a group flagged as
        the drafter's (lookahead hashes keep the flags), sub-block hits, and
        no re-prefilled tokens (a multi-module MTP drafter caches short of a
        chunk's end, where a junction stop would be refused)."""
        return (
            self.shared_prefix_checkpoint
            and bool(self.eagle_group_ids)
            and self.partial_hits
            and self.reprefillable_tokens == 0
        )

    @property
    def partial_hits(self) -> bool:
        """Sub-block (hash-unit) hits: some Mamba block is wider than the unit
        (prefix caching on: the no-prefix-cache coordinator has none)."""
        return self.prefix_caching and any(
            self.groups[i].block_size > self.hash_unit for i in self.mamba_group_ids
        )


class UnsupportedConfig(KvgateError, ValueError):
    """A config outside what a target (or the model) can run.

    `field` names the config key, so the error reads as one line. Two kinds
    (subclasses) say whose refusal it is: `NotModelled` (kvgate's own: a
    config kvgate does not model, which vLLM may well serve) and
    `RefusedByVllm` (vLLM's: a config vLLM itself refuses; the model states
    the rule, the vLLM target leaves it to vLLM).
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


class NotModelled(UnsupportedConfig):
    """Refused by kvgate, by name: outside what the model covers (vLLM may
    run it). Every target refuses it the same way, before building anything."""


class RefusedByVllm(UnsupportedConfig):
    """A config vLLM refuses. Raised by the model side (`vllm_rules`, kvgate's
    statement of vLLM's rule) and by the vLLM target (vLLM's own refusal,
    mapped to the field); a refusal trace (`expect_refused`) checks that the
    two agree."""
