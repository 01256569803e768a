"""`kvgate gate --deployment SERVE-ARGS...`: the gate on the deployment a
`vllm serve` command line resolves to.

The command line is resolved as `kvgate deployment` resolves it
(`impl/serve_flags.py`, the served blocks included); the bundled scenario
families are generated at exactly that config, their expectations written
by kvgate's scheduler model (`conformance/deployment_families.py`), into a
folder the gate then runs beside the bundled corpus, on the same target and
in the same lockstep. What the gate could not run as the deployment runs is
said in a line of its own before the verdict.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from kvgate import options
from kvgate.conformance.deployment_families import ACCEPTANCE, FamilyTrace, generate
from kvgate.conformance.trace import Trace
from kvgate.errors import InputError
from kvgate.impl.serve_flags import resolve, serve_args
from kvgate.targets import scheduler_factories
from kvgate.vocabulary.config import Config
from kvgate.vocabulary.scheduling import EngineSettings

# The pool resolve() needs for a config; each family sizes its own.
_ANY_POOL = 64


# The exploration's budget: examples of this many steps each, seeded.
EXPLORE_EXAMPLES = 12
EXPLORE_STEPS = 20


@dataclass(frozen=True)
class DeploymentRun:
    """The folder of generated traces, the lines the report shows, and
    whether the exploration at the deployment failed."""

    folder: Path
    lines: list[str]
    explored_failure: bool = False
    # Capability name -> what lacking it costs at the deployment.
    costs: dict[str, str] = dataclasses.field(default_factory=dict)


def _cached(trace: Trace) -> dict[str, int]:
    """Each request's cached tokens at its first prefill, as the trace expects."""
    found: dict[str, int] = {}
    for entry in trace.engine:
        for req, tokens in entry.expect.get("cached_tokens", {}).items():
            found.setdefault(req, int(tokens))
    return found


def hold_cost(traces: list[FamilyTrace]) -> str | None:
    """What the hold saves at the deployment: over the families generated in
    both hold arms, the lookups that miss their cached prefix entirely
    without it and the cached tokens computed again, as the model expects
    them in the two arms (None when the hold changes no hit there)."""
    arms = {t.name: t.trace for t in traces}
    misses = tokens = 0
    families: list[str] = []
    for name, on in arms.items():
        if not name.endswith(".hold-on"):
            continue
        off = arms.get(name.removesuffix(".hold-on") + ".hold-off")
        if off is None:
            continue
        with_hold, without = _cached(on), _cached(off)
        lost = {r: with_hold[r] - without.get(r, 0) for r in with_hold}
        lost = {r: n for r, n in lost.items() if n > 0}
        if lost:
            families.append(name.removeprefix("deploy-").removesuffix(".hold-on"))
        misses += sum(1 for r in lost if without.get(r, 0) == 0)
        tokens += sum(lost.values())
    if not families:
        return None
    return (
        f"at the deployment: {misses} lookups miss their cached prefix entirely without it "
        f"({tokens} cached tokens to compute again) in the families generated at its config "
        f"({', '.join(families)}), as the model expects them in their two hold arms"
    )


def explore_at(
    config: Config, target: str, plugin: str | None, seed: int, folder: Path
) -> tuple[bool, str]:
    """A short seeded manager-level exploration at `config` (its pool one a
    family's pressure shows in), in lockstep with vLLM on `--target vllm`
    (with the hold overlay under `--plugin` naming it): (failed, its line)."""
    try:
        from kvgate.explore import differential, profiles, runner
    except ImportError:
        return False, "exploration: not run: it needs Hypothesis (pip install kvgate[explore])"
    if target == "model":
        mode = runner.model_mode(hold=False, check_hold_only=False)
        against = "on the model"
    elif plugin == options.OVERLAY_PLUGIN:
        mode = differential.overlay_differential_mode()
        against = "on the model and vLLM with the hold overlay in lockstep"
    else:
        mode = differential.differential_mode()
        against = "on the model and vLLM in lockstep"
    mode = dataclasses.replace(mode, config=config, swarm=False)
    settings = profiles.profile(
        "dev", max_examples=EXPLORE_EXAMPLES, stateful_step_count=EXPLORE_STEPS
    )
    outcome = runner.explore(mode, settings, out=folder / "explored", seed=seed)
    budget = (
        f"{EXPLORE_EXAMPLES} examples of up to {EXPLORE_STEPS} steps, seed {seed}, "
        f"pool {config.num_blocks} blocks, {against}"
    )
    if outcome.failure is None:
        return False, f"exploration: clean at that config ({budget})"
    saved = f", saved as {outcome.saved}" if outcome.saved is not None else ""
    return True, (
        f"exploration: FAILED at that config ({budget}): {outcome.failure.summary()}{saved}"
    )


def prepare(args: argparse.Namespace) -> DeploymentRun:
    """Resolve `args.deployment` and write its families into a folder."""
    options.check_serving_machine(args)
    deployment = resolve(
        serve_args(list(args.deployment)),
        _ANY_POOL,
        args.assume_attention_backend,
        args.assume_checkpoint_alignment,
    )
    config = deployment.config
    if config is None:  # resolve() builds one whenever a pool is given
        raise InputError(f"--deployment: kvgate needs {deployment.config_missing}")
    values = deployment.values
    drafts = int(values["drafts"])
    lines: list[str] = []
    for name, why in deployment.unmodelled:
        lines.append(
            f"deployment: kvgate cannot model {name} ({why}): the verdict says nothing of it"
        )
    if config.async_scheduling:
        accepting = f", {ACCEPTANCE}" if drafts else ""
        lines.append(
            "deployment: async scheduling, as the deployment schedules: the families run "
            f"with a batch in flight on vLLM's AsyncScheduler{accepting}; an abort is its "
            "own entry between steps"
        )
    folder = args.deployment_traces
    if folder is None:
        folder = Path(tempfile.mkdtemp(prefix="kvgate-deployment-"))
        atexit.register(shutil.rmtree, folder, True)
        kept = "pass --deployment-traces DIR to keep them"
    else:
        kept = f"kept in {folder}"
    model, _ = scheduler_factories("model", None)
    traces, skipped = generate(
        config, EngineSettings(spec=drafts, max_num_seqs=int(values["max_num_seqs"])), model, folder
    )
    group = config.groups[0].block_size
    mamba = config.groups[-1].block_size
    lines.insert(
        0,
        f"deployment: {values['model']}: attention block {group}, Mamba block {mamba} "
        f"({values.get('attention backend', 'no attention layers')}), hash unit "
        f"{config.hash_unit}, {drafts} drafts (prefill lookahead {values['prefill lookahead']}, "
        f"hash lookahead {config.hash_lookahead_tokens}), token budget "
        f"{config.max_num_scheduled_tokens}, max_num_seqs {values['max_num_seqs']}, "
        f"max_model_len {config.max_model_len}",
    )
    lines.insert(
        1,
        f"deployment: {len(traces)} traces of {len({t.name.split('.')[0] for t in traces})} "
        "scenario families generated at that config, their expectations from kvgate's model, "
        f"each family's pool the smallest its pressure shows in ({kept})",
    )
    if config.kv_connector:
        lines.append(
            "deployment: the KV connector's paths run in the bundled corpus's connector traces, "
            "not generated at this config"
        )
    lines.extend(f"deployment: {line}" for line in skipped)
    pools = [t.trace.config.num_blocks for t in traces if "next-turn" in t.name]
    # The exploration is manager-level, whose calls async scheduling does not
    # change (only scheduler-level traces model it).
    explored = replace(
        config, num_blocks=pools[0] if pools else _ANY_POOL, hold=False, async_scheduling=False
    )
    failed, line = explore_at(explored, args.target, options.plugin_of(args), args.seed, folder)
    lines.append(f"deployment: {line}")
    cost = hold_cost(traces)
    return DeploymentRun(folder, lines, failed, {"hold": cost} if cost else {})
