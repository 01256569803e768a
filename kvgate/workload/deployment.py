"""The deployment a workload trace is sized for: a manager config per unit.

The production measurement ran a Qwen3-Next-class hybrid model (full
attention every fourth layer, Gated DeltaNet in the others) with tensor
parallelism over four 24 GB GPUs. kvgate's trace format models one pool of
uniform blocks shared by both groups, so the deployment is reduced to that:

- with prefix caching (align mode) an attention block holds as many tokens
  as a Mamba block, as vLLM's worker serves them (it sets the Mamba block to
  the attention block, raised to hold a Mamba page), and the hash unit,
  `unit`, is the finer grid prefixes are matched on; a block is one
  attention page;
- the attention capacity in tokens is what the per-GPU cache memory holds
  once the Mamba states of every concurrent session are set aside, the same
  at every unit;
- a Mamba state takes one block, as in vLLM's unified page pool, so the pool
  adds one Mamba footprint per concurrent session (its running state and K
  scratch blocks) on top of the attention blocks. Charging states from the
  attention capacity instead would cost 4096 tokens per state at unit 4096
  and 64 at unit 64, i.e. far more pressure at the larger units. The price:
  while a session sits in a tool call its footprint serves attention, at
  most `footprint x unit` extra tokens (see `describe()`).

Every number is a field with the assumption next to it, so a run states
what it assumed; `scaled(k)` divides every token quantity by `k` for quick
runs and tests (the memory arithmetic is done at full size first).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from kvgate.model.scope import validate
from kvgate.vocabulary.config import Config, GroupConfig, KvLoadFailurePolicy
from kvgate.vocabulary.schema import config_default

GIB = 1 << 30

# The serving build. "fork" is the production build the measurement ran on:
# under its switch it always retained each request's newest retired Mamba
# state (trace config `retain_retired`); its patch 0093 added the partial-tail
# hold (`retain_checkpoint`). "upstream" is vLLM 0.33.0, which retains none.
Build = Literal["fork", "upstream"]
BUILDS: tuple[Build, ...] = ("fork", "upstream")


@dataclass(frozen=True)
class Serving:
    """What the scheduler model needs of a deployment besides its config:
    the system prompt every session shares (in scaled tokens), the drafts per
    decode step (MTP K) and the most requests running at once."""

    system_prompt: int
    spec: int
    max_num_seqs: int
    # With a KV connector: the seed of the external hits drawn per request
    # (None: no connector, nothing drawn).
    connector_seed: int | None = None


@dataclass(frozen=True)
class Deployment:
    # -- hardware ------------------------------------------------------------
    gpus: int = 4  # tensor parallel over 4 GPUs
    gpu_memory_gib: float = 24.0  # RTX 3090 / 4090 class
    gpu_memory_utilization: float = 0.90  # vLLM's --gpu-memory-utilization
    # 80B-parameter MoE at ~4.4 bits/weight (AWQ/GPTQ int4 + fp16 embeddings
    # and norms), split over the GPUs.
    weights_gib: float = 44.0
    # Activations, CUDA graphs, MoE and sampler buffers, per GPU.
    runtime_overhead_gib: float = 2.0
    # -- model (Qwen3-Next-80B-A3B shapes) -------------------------------------
    attention_layers: int = 12  # full attention: every 4th of 48 layers
    kv_heads: int = 2  # GQA; below the TP size each GPU keeps one replica
    head_dim: int = 256
    kv_dtype_bytes: int = 2  # bf16 KV cache
    mamba_layers: int = 36  # Gated DeltaNet layers
    linear_key_heads: int = 16
    linear_value_heads: int = 32
    linear_head_dim: int = 128
    conv_kernel: int = 4
    state_dtype_bytes: int = 2  # bf16 SSM and conv state
    # A served model's pages as vLLM computes them for one layer on one GPU
    # (`kvgate workload --deployment`), in place of the shapes above.
    attention_page_per_token: int | None = None
    mamba_page_bytes: int | None = None
    # -- serving ----------------------------------------------------------------
    mamba_block_size: int = 4096  # align-mode Mamba block = scheduler block
    spec_tokens: int = 3  # MTP K=3: three drafts per decode step
    eagle: bool = True  # an MTP/EAGLE drafter
    # Qwen3-Next ships one MTP layer, reused for every draft: vLLM derives
    # a prefill lookahead of 1 and lookahead block hashes over 1 token.
    hash_lookahead_tokens: int = 1
    retention_interval: int | None = 0  # sparse retention (deployed default)
    max_num_scheduled_tokens: int = 8192  # token budget per step (2 Mamba blocks)
    max_num_seqs: int = 16
    max_model_len: int = 131072
    build: Build = "fork"
    # The deployment's settings that are trace config fields of the same
    # name (docs/reference/knobs.md says what each is), at the config's
    # defaults. A KV connector here is an offloading store beside the prefix
    # cache: each request's external hit is drawn (sync or async). Without
    # prefix caching, the engine config runs every Mamba layer in cache mode
    # `none` with its block `max_model_len` long (its only size there), and
    # the scheduler block is the groups' lcm: `config()` sets all three, as
    # vLLM resolves them.
    kv_connector: bool = config_default("kv_connector")
    kv_connector_divergent_hits: bool = config_default("kv_connector_divergent_hits")
    kv_load_failure_policy: KvLoadFailurePolicy = config_default("kv_load_failure_policy")
    prefix_caching: bool = config_default("prefix_caching")
    # Every token quantity below is divided by this (see `scaled`).
    scale: int = 1
    # The model a serve command line named (`kvgate workload --deployment`);
    # "" for the bundled deployment.
    served_from: str = ""

    # -- derived memory arithmetic (full size, per GPU) -------------------------

    @property
    def kv_heads_per_gpu(self) -> int:
        return max(1, self.kv_heads // self.gpus)

    @property
    def attention_bytes_per_token(self) -> int:
        """K and V of every full-attention layer, on one GPU."""
        if self.attention_page_per_token is not None:
            return self.attention_layers * self.attention_page_per_token
        return (
            self.attention_layers * 2 * self.kv_heads_per_gpu * self.head_dim * self.kv_dtype_bytes
        )

    @property
    def mamba_state_bytes(self) -> int:
        """One request state (SSM + conv) of every Gated DeltaNet layer, on one GPU."""
        if self.mamba_page_bytes is not None:
            return self.mamba_layers * self.mamba_page_bytes
        value_heads = self.linear_value_heads // self.gpus
        ssm = value_heads * self.linear_head_dim * self.linear_head_dim
        conv_dim = (2 * self.linear_key_heads + self.linear_value_heads) * self.linear_head_dim
        conv = (self.conv_kernel - 1) * (conv_dim // self.gpus)
        return self.mamba_layers * (ssm + conv) * self.state_dtype_bytes

    @property
    def cache_bytes(self) -> int:
        """Per-GPU memory left for the KV cache and Mamba states."""
        usable = self.gpu_memory_gib * self.gpu_memory_utilization
        left = usable - self.weights_gib / self.gpus - self.runtime_overhead_gib
        if left <= 0:
            raise ValueError("the deployment leaves no memory for the KV cache")
        return int(left * GIB)

    @property
    def mamba_footprint(self) -> int:
        """Mamba blocks a running request keeps: its state and K scratch blocks."""
        return 1 + self.spec_tokens

    def attention_capacity_tokens(self, concurrency: int) -> int:
        """Attention tokens the pool holds at full size (before `scale`), with
        the Mamba states of `concurrency` running requests set aside."""
        states = concurrency * self.mamba_footprint * self.mamba_state_bytes
        if states >= self.cache_bytes:
            raise ValueError(f"{concurrency} sessions' Mamba states fill the cache memory")
        return (self.cache_bytes - states) // self.attention_bytes_per_token

    # -- what a trace runs on -----------------------------------------------------

    def tokens(self, n: int) -> int:
        """A full-size token quantity at this deployment's scale."""
        if n % self.scale:
            raise ValueError(f"{n} tokens do not divide by scale {self.scale}")
        return n // self.scale

    def attention_block(self, unit: int) -> int:
        """The attention block at hash unit `unit` (scaled): the Mamba block
        with prefix caching (align mode), as the worker serves it; the unit
        without (no prefix is matched, and the Mamba block is max_model_len)."""
        return self.tokens(self.mamba_block_size) if self.prefix_caching else unit

    def num_blocks(self, unit: int, concurrency: int) -> int:
        """Pool size at `unit` (a scaled unit): the same attention capacity at
        every unit, plus each concurrent session's Mamba footprint."""
        block = self.attention_block(unit)
        attention = self.attention_capacity_tokens(concurrency) // self.scale // block
        return attention + concurrency * self.mamba_footprint + 1  # + the null block

    def config(self, unit: int, hold: bool, concurrency: int) -> Config:
        """The manager config of one arm: hash unit `unit`, the attention and
        Mamba blocks as the worker serves them."""
        block = self.tokens(self.mamba_block_size)
        if block % unit:
            raise ValueError(f"unit {unit} does not divide the Mamba block {block}")
        if not self.prefix_caching:
            # Mode none's Mamba block; the scheduler block, their lcm. (The
            # engine's hash block is then the scheduler block too: nothing is
            # hashed, so the unit stands in, which the model sizes keys by.)
            block = self.tokens(self.max_model_len)
            if block % unit:
                raise ValueError(f"unit {unit} does not divide max_model_len {block}")
        config = Config(
            num_blocks=self.num_blocks(unit, concurrency),
            hash_unit=unit,
            groups=(
                GroupConfig("full_attention", self.attention_block(unit)),
                GroupConfig("mamba_align", block, speculative_blocks=self.spec_tokens),
            ),
            eagle=self.eagle,
            # vLLM hashes ahead only with prefix caching, and keeps legacy
            # block hashes (none ahead) under a KV connector.
            hash_lookahead_tokens=(
                self.hash_lookahead_tokens
                if self.eagle and self.prefix_caching and not self.kv_connector
                else 0
            ),
            retention_interval=self.retention_interval,
            hold=hold,
            # The fork's retention, like the hold, acts only with prefix caching.
            retain_retired=self.build == "fork" and self.prefix_caching,
            scheduler_block_size=block,
            max_model_len=self.tokens(self.max_model_len),
            max_num_scheduled_tokens=self.tokens(self.max_num_scheduled_tokens),
            kv_connector=self.kv_connector,
            kv_connector_divergent_hits=self.kv_connector_divergent_hits,
            kv_load_failure_policy=self.kv_load_failure_policy,
            # vLLM's default admission gate: with a connector the re-admission
            # after an async load has no lookup for the generator's own gate.
            reserve_full_sequence=self.kv_connector,
            prefix_caching=self.prefix_caching,
            mamba_cache_mode="align" if self.prefix_caching else "none",
        )
        validate(config)
        return config

    def connector_tags(self) -> str:
        """What a file or trace name says of the KV connector besides whether
        there is one: per-group local lookups, and a load-failure policy other
        than the default."""
        policy = self.kv_load_failure_policy
        return ("-divergent" if self.kv_connector_divergent_hits else "") + (
            f"-{policy}" if policy != config_default("kv_load_failure_policy") else ""
        )

    def scaled(self, scale: int) -> Deployment:
        """Every token quantity divided by `scale`: block, budget, pool, lengths."""
        if scale < 1:
            raise ValueError("scale must be >= 1")
        scaled = replace(self, scale=scale)
        for n in (self.mamba_block_size, self.max_num_scheduled_tokens, self.max_model_len):
            scaled.tokens(n)  # raises when a quantity does not divide
        return scaled

    def serving(self, system_prompt: int, seed: int = 0) -> Serving:
        """How this deployment serves sessions sharing a `system_prompt` of
        that many full-size tokens (`seed`: the workload's, for the external
        hits a KV connector's store is drawn to hold)."""
        return Serving(
            system_prompt // self.scale,
            self.spec_tokens,
            self.max_num_seqs,
            seed if self.kv_connector else None,
        )

    def describe(self, units: tuple[int, ...], concurrency: int) -> list[str]:
        """The assumptions and what they come to, one line each (`units` scaled)."""
        mib = 1 << 20
        capacity = self.attention_capacity_tokens(concurrency)
        footprint = concurrency * self.mamba_footprint
        # Blocks of sessions in a tool call serve attention meanwhile.
        idle = footprint * max(units) * self.scale / capacity
        served = (
            [
                f"served: {self.served_from}, as vLLM resolves the serve command line "
                "(kvgate deployment shows each setting's source); not from its flags: "
                f"{self.gpu_memory_gib:g} GiB a GPU (--gpu-memory-gib), weights "
                f"{self.weights_gib:g} GiB (--weights-gib), overhead "
                f"{self.runtime_overhead_gib:g} GiB a GPU (--runtime-overhead-gib)"
            ]
            if self.served_from
            else []
        )
        return served + [
            f"deployment: {self.gpus}x{self.gpu_memory_gib:g} GiB, utilization "
            f"{self.gpu_memory_utilization:g}, weights {self.weights_gib:g} GiB, overhead "
            f"{self.runtime_overhead_gib:g} GiB/GPU -> {self.cache_bytes / GIB:.2f} GiB/GPU "
            "for KV cache and Mamba states",
            f"attention: {self.attention_layers} layers, {self.attention_bytes_per_token} "
            f"B/token/GPU -> {capacity:,} tokens of capacity after {footprint} Mamba states",
            f"mamba: {self.mamba_layers} layers, "
            + (
                f"block {self.mamba_block_size} tokens"
                if self.prefix_caching
                else f"no prefix caching: cache mode none, block max_model_len "
                f"{self.max_model_len} tokens"
            )
            + ", state "
            f"{self.mamba_state_bytes / mib:.1f} MiB/GPU; pool adds {concurrency} sessions x "
            f"{self.mamba_footprint} blocks (state + {self.spec_tokens} scratch)",
            f"serving: MTP K={self.spec_tokens} (spec {self.spec_tokens}, lookahead hashes "
            f"{self.hash_lookahead_tokens if self.eagle else 0}), eagle {self.eagle}, "
            f"attention block = Mamba block, retention interval "
            f"{self.retention_interval}, {self.max_num_scheduled_tokens} tokens/step, "
            f"max {self.max_num_seqs} seqs, max_model_len {self.max_model_len}"
            + (f"; every token count / {self.scale}" if self.scale > 1 else ""),
            f"build: {self.build} ("
            + (
                "retired states retained in both arms; hold on = the partial-tail hold added"
                if self.build == "fork"
                else "vLLM 0.33.0: no retired state retained; hold on = the partial-tail hold alone"
            )
            + ")"
            + (
                "; KV connector: each request's external hit drawn (none, sync or async)"
                + (", per-group local lookups" if self.kv_connector_divergent_hits else "")
                + f", load-failure policy {self.kv_load_failure_policy}"
                if self.kv_connector
                else ""
            ),
            "pool: "
            + ", ".join(f"{self.num_blocks(u, concurrency):,} blocks at unit {u}" for u in units)
            + f"; idle sessions' footprints add <= {idle:.0%} attention capacity "
            f"at unit {max(units)}",
        ]
