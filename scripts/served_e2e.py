"""End to end against a real vLLM server: record what it does, then gate it.

Three stages, each run by `scripts/served-e2e.sh`:

- `prepare DIR` (in the served environment, vLLM's CPU build): a tiny
  Qwen3-Next written locally (3 Gated DeltaNet layers and 1 full-attention
  layer, MoE layers, GDN head dim 128; random weights, loaded with
  `load_format=dummy`) and a local word-level tokenizer with a chat template.
- `serve DIR OUT` (in the served environment): vLLM's OpenAI server on
  127.0.0.1 (started with `setsid`, stopped by its process id) with prefix
  caching, Mamba cache mode `align`, a small KV-cache pool and
  `KVGATE_RECORD` set, driven by a bounded multi-turn agent load through the
  `openai` client: chat and completions, concurrent sessions sharing a
  system prompt, streaming, a client that disconnects mid-stream, requests
  side by side that outgrow the pool (the Scheduler preempts), stop
  strings, a prefix-cache reset through the server. With
  `--kill` the server is killed with SIGKILL mid-load instead. Writes
  `OUT/load.json` (what the client sent) and the server's log.
- `check OUT` (in the environment with the pinned vLLM): every request the
  client sent is in the recordings, no recording stopped, at least one
  preemption is recorded, each follow-up whose history re-tokenizes to the
  earlier request's tokens (and no other request) is written `all_of` it,
  every recording replays PASS at strict level on the model and on vLLM's
  Scheduler, and a copy with one expected value changed fails at its step;
  with `--killed`,
  the recordings replay with `--partial` and the report and JUnit say where
  each was cut. Writes `OUT/measured.json`.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

VOCAB_WORDS = 400
SPECIAL = ["<unk>", "<pad>", "<eos>", "<system>", "<user>", "<assistant>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
MODEL_NAME = "tiny-qwen3-next"
# The block size the engine is started with (see `Server`): the attention
# block, the Mamba block and the prefix cache's hash unit.
BLOCK_SIZE = int(os.environ.get("SERVED_E2E_BLOCK_SIZE", "384"))
# The shared system prompt's words: with its role's token before it and the
# next role's after, it fills two whole blocks, so the sessions resume from
# the Mamba state cached at its end and differ right after it.
SYSTEM_WORDS = 2 * BLOCK_SIZE - 2
# A session's first message: long enough that its prompt ends at least one
# whole block past the system prompt. A request whose prefix-cache hit ends
# at its prompt's last whole block keys that block's Mamba state again;
# vLLM 0.32.0 then counts the shared block as cached in that step and holds
# back every other request resuming from it until the next step, where
# 0.33.0 (and kvgate's model) admit them together. With the hit ending a
# block or more before the prompt's last whole block, both releases admit
# the sessions' first requests alike, however their arrivals fall into steps.
# (The other requests resuming from the system prompt with less than a block
# of their own, the warm-up, the disconnects and the stop strings, each wait
# alone: each is sent once the requests before it run or have ended.)
FIRST_MESSAGE_WORDS = BLOCK_SIZE
SEED = 7


def words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(VOCAB_WORDS)}" for _ in range(n))


# ------------------------------------------------------------------ prepare


def tiny_qwen3_next(eos_token_id: int) -> Any:
    """A tiny Qwen3-Next as vLLM's CPU build serves it: three Gated DeltaNet
    layers (head dim 128, which its kernels require) and one full-attention
    layer, MoE feed-forward layers (vLLM finds no Qwen3-Next layer without
    them), weights never loaded (`load_format=dummy`)."""
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(  # type: ignore[call-arg]
        architectures=["Qwen3NextForCausalLM"],
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        linear_num_key_heads=1,
        linear_num_value_heads=1,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=4096,
        eos_token_id=eos_token_id,
        torch_dtype="bfloat16",
    )


def prepare(model: Path) -> None:
    """The tiny model's config and tokenizer, written into `model`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model.mkdir(parents=True, exist_ok=True)
    config = tiny_qwen3_next(SPECIAL.index("<eos>"))
    config.save_pretrained(model)
    vocab = {word: i for i, word in enumerate(SPECIAL)}
    for i in range(VOCAB_WORDS):
        vocab[f"w{i}"] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        pad_token="<pad>",
        eos_token="<eos>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(model)
    print(f"prepared {model}: Qwen3-Next, 4 layers (3 GDN), vocab {len(vocab)}")


# -------------------------------------------------------------------- serve


class Server:
    """vLLM's OpenAI server in its own session, on 127.0.0.1."""

    def __init__(self, model: Path, out: Path, port: int, blocks: int, record: bool = True) -> None:
        self.out = out
        self.port = port
        env = dict(os.environ)
        env.pop("KVGATE_RECORD", None)
        if record:
            env["KVGATE_RECORD"] = str(out / "recordings")
        env.update(
            # Parts end at this many entries: a load this long goes on in parts.
            KVGATE_RECORD_MAX_STEPS=env.get("KVGATE_RECORD_MAX_STEPS", "150"),
            KVGATE_RECORD_MAX_FILES=env.get("KVGATE_RECORD_MAX_FILES", "64"),
            VLLM_TARGET_DEVICE="cpu",
            VLLM_SERVER_DEV_MODE="1",  # the reset endpoint
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_LOGGING_LEVEL="INFO",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
        )
        command = [
            "setsid",
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--model",
            str(model),
            "--served-model-name",
            MODEL_NAME,
            "--load-format",
            "dummy",
            "--dtype",
            "bfloat16",  # vLLM's CPU Gated DeltaNet kernels require it
            "--enable-prefix-caching",
            "--mamba-cache-mode",
            "align",
            "--max-model-len",
            "2048",
            "--max-num-seqs",
            "6",
            "--max-num-batched-tokens",
            "1024",  # long prompts run in chunks
            "--num-gpu-blocks-override",
            str(blocks),
            # The block size vLLM's worker sizes the attention block to for
            # this model (its page at least a Mamba state's), given to the
            # engine too: vLLM's CPU platform would otherwise split prefills at
            # its default block size of 128, apart from the Scheduler's.
            "--block-size",
            str(BLOCK_SIZE),
            # Time for the engine process to shut its Scheduler down on
            # SIGTERM (which ends each recording's file with its end line);
            # vLLM's default, 0, kills it at once.
            "--shutdown-timeout",
            "30",
            "--enforce-eager",
            "--seed",
            str(SEED),
        ]
        self.log = (out / "server.log").open("w")
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            command, env=env, stdout=self.log, stderr=subprocess.STDOUT, cwd=out
        )
        (out / "server.pid").write_text(str(self.process.pid))

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"the server exited ({self.process.returncode}); see its log")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=5) as response:
                    if response.status == 200:
                        return time.monotonic() - self.started
            except OSError:
                pass
            time.sleep(2)
        raise SystemExit(f"the server was not ready within {timeout:.0f}s")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 120) -> None:
        """Stop the server by its process id: SIGTERM lets it shut its
        engine down (the Scheduler's shutdown ends each recording's file);
        SIGKILL kills its whole session at once, as a crash would."""
        if self.process.poll() is None:
            if sig == signal.SIGKILL:
                os.killpg(self.process.pid, sig)
            else:
                os.kill(self.process.pid, sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()

    def reset_prefix_cache(self) -> bool:
        request = urllib.request.Request(self.base + "/reset_prefix_cache", method="POST")
        with urllib.request.urlopen(request, timeout=60) as response:
            return bool(response.status == 200)


class Load:
    """The client side: what it sent, counted by kind."""

    def __init__(self, base: str) -> None:
        from openai import OpenAI

        self.client: Any = OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600)
        self.lock = threading.Lock()
        self.sent: dict[str, int] = {}
        self.errors: list[str] = []
        self.finish_reasons: dict[str, int] = {}
        # Follow-up turns by kind ("chat", "completion"): [sent, sharing],
        # sharing those whose history re-tokenizes to the earlier request's
        # whole sequence (see `session`).
        self.follow_ups: dict[str, list[int]] = {}

    def follow_up(self, kind: str, shares: bool) -> None:
        with self.lock:
            counts = self.follow_ups.setdefault(kind, [0, 0])
            counts[0] += 1
            counts[1] += int(shares)

    def count(self, kind: str, finish: str | None = None) -> None:
        with self.lock:
            self.sent[kind] = self.sent.get(kind, 0) + 1
            if finish is not None:
                self.finish_reasons[finish] = self.finish_reasons.get(finish, 0) + 1

    def chat(self, messages: list[dict[str, str]], max_tokens: int, **kw: Any) -> str:
        self.count("chat", None)
        reply = self.client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=max_tokens, temperature=0, **kw
        )
        choice = reply.choices[0]
        self.count_finish(choice.finish_reason)
        return choice.message.content or ""

    def complete(self, prompt: str, max_tokens: int, **kw: Any) -> str:
        self.count("completion", None)
        reply = self.client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0, **kw
        )
        self.count_finish(reply.choices[0].finish_reason)
        return str(reply.choices[0].text)

    def stream_chat(self, messages: list[dict[str, str]], max_tokens: int, keep: int) -> str:
        """A streamed chat reply; the client goes away after `keep` chunks
        (0: it reads to the end)."""
        self.count("chat-stream" if not keep else "chat-stream-disconnect", None)
        stream = self.client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
        )
        text = ""
        for chunks, chunk in enumerate(stream, 1):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                if chunk.choices[0].finish_reason:
                    self.count_finish(chunk.choices[0].finish_reason)
            if keep and chunks >= keep:
                stream.close()  # the client disconnects mid-stream
                self.count_finish("disconnected")
                break
        return text

    def count_finish(self, reason: str | None) -> None:
        with self.lock:
            key = str(reason)
            self.finish_reasons[key] = self.finish_reasons.get(key, 0) + 1

    def guarded(self, what: str, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except Exception as error:  # counted: the run fails on any
            with self.lock:
                self.errors.append(f"{what}: {type(error).__name__}: {error}"[:300])
            return ""


def session(load: Load, rng: random.Random, system: str, number: int, turns: int) -> None:
    """One agent session: a conversation of `turns` turns, each a user
    message and the reply; chat sessions re-send the history, completion
    sessions send the whole text so far as the next prompt."""
    use_chat = number % 2 == 0
    history: list[dict[str, str]] = [{"role": "system", "content": system}]
    text = f"<system> {system}"
    # Whether the last reply comes back as the tokens the engine generated:
    # with the word-level tokenizer, a reply of exactly its max_tokens words
    # ended at its length, and each of its tokens decoded to one word, which
    # the next prompt's tokenization turns back into that token. A reply
    # ended by the end-of-sequence token, or holding a token the decoder
    # drops, comes back shorter than what the engine generated.
    shares = False
    for turn in range(turns):
        if turn:
            load.follow_up("chat" if use_chat else "completion", shares)
        user = words(rng, rng.randint(20, 120) + (FIRST_MESSAGE_WORDS if not turn else 0))
        # Long enough replies that sessions decode side by side (the pool
        # pressure that preempts for certain comes after, in `pressure`).
        max_tokens = rng.randint(40, 160)
        if use_chat:
            history.append({"role": "user", "content": user})
            if turn == 1:
                reply = load.guarded(
                    "stream", functools.partial(load.stream_chat, history, max_tokens, keep=0)
                )
            else:
                reply = load.guarded("chat", functools.partial(load.chat, history, max_tokens))
            history.append({"role": "assistant", "content": reply})
        else:
            text += f" <user> {user} <assistant>"
            reply = load.guarded("complete", functools.partial(load.complete, text, max_tokens))
            text += " " + reply
        shares = len(reply.split()) == max_tokens


def stop_strings(load: Load, rng: random.Random, system: str) -> int:
    """Requests ended by a stop string: a greedy reply read once, then the
    same prompt again with a word of that reply as its stop string (so the
    server's detokenizer meets it). How many were sent with a stop."""
    sent = 0
    for _ in range(3):
        prompt = f"<system> {system} <user> {words(rng, 30)} <assistant>"
        first = load.guarded("probe", functools.partial(load.complete, prompt, 12))
        found = first.split()
        if len(found) < 4:
            continue
        stop = found[3]
        load.guarded("stop", functools.partial(load.complete, prompt, 12, stop=[stop]))
        sent += 1
    return sent


def disconnects(load: Load, rng: random.Random, system: str) -> None:
    """Clients that go away mid-stream, while their requests decode."""
    for _ in range(2):
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": words(rng, 40)},
        ]
        load.guarded("disconnect", functools.partial(load.stream_chat, messages, 200, keep=4))


# The pool pressure that makes the Scheduler preempt, whatever the timing:
# this many requests side by side, each a prompt of its own (nothing cached
# to share) filling most of two 384-token blocks, and replies long enough
# (`ignore_eos`) to need a third attention block each. Every running request
# holds a Mamba state per Gated DeltaNet layer besides its attention blocks,
# so the pool (`--blocks`, 20 by default) cannot hold them all past their
# second block: the Scheduler preempts. (kvgate's model of the Scheduler
# preempts with these sizes for arrivals up to 25 engine steps apart.)
PRESSURE_REQUESTS = 4
PRESSURE_PROMPT = 700
PRESSURE_REPLY = 100


def pressure(load: Load, rng: random.Random) -> None:
    """Requests side by side that outgrow the pool: the Scheduler preempts."""
    prompts = [f"<user> {words(rng, PRESSURE_PROMPT - 1)}" for _ in range(PRESSURE_REQUESTS)]
    threads = [
        threading.Thread(
            target=load.guarded,
            args=(
                "pressure",
                functools.partial(
                    load.complete, prompt, PRESSURE_REPLY, extra_body={"ignore_eos": True}
                ),
            ),
        )
        for prompt in prompts
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def serve(
    model: Path, out: Path, port: int, blocks: int, kill: bool, sessions: int, turns: int
) -> None:
    model, out = model.resolve(), out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out / "recordings", ignore_errors=True)
    server = Server(model, out, port, blocks)
    summary: dict[str, Any] = {
        "blocks": blocks,
        "sessions": sessions,
        "turns": turns,
        "max_entries": int(os.environ.get("KVGATE_RECORD_MAX_STEPS", "150")),
    }
    try:
        summary["startup_seconds"] = round(server.wait_ready(600), 1)
        print(f"server ready after {summary['startup_seconds']}s", flush=True)
        load = Load(server.base)
        rng = random.Random(SEED)
        system = words(rng, SYSTEM_WORDS)
        started = time.monotonic()
        # The shared system prompt computed once before the sessions start,
        # so that each session's first request resumes from its cached state.
        warm = [{"role": "system", "content": system}, {"role": "user", "content": "w1"}]
        load.guarded("warm", functools.partial(load.chat, warm, 4))
        threads = [
            threading.Thread(target=session, args=(load, random.Random(SEED + i), system, i, turns))
            for i in range(sessions)
        ]
        side = [threading.Thread(target=disconnects, args=(load, random.Random(SEED - 1), system))]
        # All at once: the sessions' first requests wait side by side, each
        # resuming from the shared system prompt (see FIRST_MESSAGE_WORDS).
        for thread in threads:
            thread.start()
        if kill:
            # Killed mid-load: while the sessions' requests run.
            time.sleep(float(os.environ.get("SERVED_E2E_KILL_AFTER", "5")))
            summary["load_seconds"] = round(time.monotonic() - started, 1)
            server.stop(signal.SIGKILL)
            for thread in threads:
                thread.join()
            summary["killed"] = True
        else:
            for thread in threads:
                thread.join()
            for thread in side:
                thread.start()
                thread.join()
            pressure(load, random.Random(SEED + 300))
            summary["pressure_requests"] = PRESSURE_REQUESTS
            summary["stop_strings"] = stop_strings(load, random.Random(SEED + 100), system)
            if server.process.poll() is not None:
                raise SystemExit(f"the server exited mid-load; see {out / 'server.log'}")
            summary["reset"] = server.reset_prefix_cache()
            # After the reset: the shared system prompt computed again.
            load.guarded("warm", functools.partial(load.chat, warm, 4))
            session(load, random.Random(SEED + 200), system, 0, 2)
            summary["load_seconds"] = round(time.monotonic() - started, 1)
            summary["errors"] = load.errors
        summary["sent"] = load.sent
        summary["requests"] = sum(load.sent.values())
        summary["finish_reasons"] = load.finish_reasons
        summary["follow_ups"] = load.follow_ups
    finally:
        server.stop()
    (out / "load.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
    print(json.dumps(summary, sort_keys=True))
    if not kill and summary.get("errors"):
        raise SystemExit(f"{len(summary['errors'])} requests failed: {summary['errors'][0]}")


# -------------------------------------------------------------------- check


def kvgate(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "kvgate", *args]
    return subprocess.run(command, capture_output=True, text=True)


def must(done: subprocess.CompletedProcess[str], code: int, what: str) -> str:
    if done.returncode != code:
        raise SystemExit(
            f"{what}: exit {done.returncode}, wanted {code}\n"
            f"{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )
    return done.stdout


def check(out: Path, killed: bool) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from kvgate.conformance.trace import load_trace

    load = json.loads((out / "load.json").read_text())
    recordings = out / "recordings"
    paths = sorted(recordings.glob("*.yaml"))
    if not paths:
        raise SystemExit(f"no recording in {recordings}")
    log = (out / "server.log").read_text(errors="replace")
    stopped = [line for line in log.splitlines() if "stopped recording" in line]
    if stopped:
        raise SystemExit(f"the recorder stopped: {stopped[0]}")
    partial = ["--partial"] if killed else []
    measured: dict[str, Any] = {
        "vllm_served": "0.32.0",
        "max_entries": int(load.get("max_entries", 0)),
        "files": len(paths),
        "parts_ends_logged": sum("limit is reached" in line for line in log.splitlines()),
    }
    # The last part of each recording holds the whole history.
    engine: list[Any] = []
    started = time.monotonic()
    for path in paths:
        trace = load_trace(path, partial=bool(partial))
        if not _followed(path):
            engine.extend(trace.engine)
            if trace.cut:
                measured.setdefault("cuts", []).append(f"{path.name}: {trace.cut}")
    arrivals = sum(e.op == "arrive" for e in engine)
    measured.update(
        requests_sent=load["requests"],
        arrivals=arrivals,
        engine_steps=sum(e.op == "step" for e in engine),
        entries=len(engine),
        aborted_inside_a_step=sum(len(e.aborted) for e in engine),
        aborted_between_steps=sum(e.op == "abort" for e in engine),
        stopped_by_a_stop_condition=sum(len(e.stop) for e in engine),
        preempted=sum(len(e.expect.get("preempted", ())) for e in engine),
        resets=sum(e.op == "reset" for e in engine),
        follow_ups_written_as_continuations=sum(
            e.op == "arrive" and e.follows is not None for e in engine
        ),
        prefill_cached_tokens=sum(sum(e.expect.get("cached_tokens", {}).values()) for e in engine),
        max_running=max((len(e.expect.get("scheduled", ())) for e in engine), default=0),
    )
    if not killed and arrivals != load["requests"]:
        raise SystemExit(
            f"the client sent {load['requests']} requests, the recordings hold {arrivals}"
        )
    print(f"preemptions recorded: {measured['preempted']}", flush=True)
    # Each follow-up whose history comes back as the earlier request's whole
    # sequence is written `all_of` that request; no other request is.
    sharing = sum(shares for _, shares in load.get("follow_ups", {}).values())
    continued = measured["follow_ups_written_as_continuations"]
    if not killed and "follow_ups" in load and continued != sharing:
        raise SystemExit(
            f"{sharing} follow-ups re-send the earlier request's tokens, "
            f"{continued} are written as all_of it"
        )
    if not killed and not measured["preempted"]:
        raise SystemExit("the recordings hold no preemption: the load did not fill the pool")
    junit = out / "gate-vllm.xml"
    for target in ("model", "vllm"):
        args = ["gate", "--no-bundled", "--corpus", str(recordings), "--target", target]
        args += ["--level", "strict"]
        args += ["--junit-xml", str(out / f"gate-{target}.xml"), *partial]
        report = must(kvgate(*args), 0, f"gate on {target}")
        if "FAIL" in report or "ERROR" in report:
            raise SystemExit(f"gate on {target}:\n{report}")
        measured[f"gate_{target}"] = report.strip().splitlines()[-1]
        print(f"gate on {target}: {measured[f'gate_{target}']}", flush=True)
    if killed:
        # The report line and the JUnit case of each cut recording say where.
        xml = junit.read_text()
        if not measured.get("cuts"):
            raise SystemExit("killed mid-load, yet no recording is cut")
        for cut in measured["cuts"]:
            name, where = cut.split(": ", 1)
            entry = where.split(":")[0]
            if f"recording cut at {entry}" not in report:
                raise SystemExit(f"the report does not say where {name} was cut:\n{report}")
            if f'<property name="cut" value="{entry}' not in xml:
                raise SystemExit(f"the JUnit file does not say where {name} was cut")
        measured["gate_seconds"] = round(time.monotonic() - started, 1)
    else:
        measured.update(changed_copy_fails(recordings, out))
        measured["gate_seconds"] = round(time.monotonic() - started, 1)
    (out / ("measured-killed.json" if killed else "measured.json")).write_text(
        json.dumps({**load, **measured}, indent=2, sort_keys=True)
    )
    print(json.dumps(measured, sort_keys=True))


def changed_copy_fails(recordings: Path, out: Path) -> dict[str, Any]:
    """A copy of the recordings with one step's expected cached tokens
    raised by one block fails at exactly that step."""
    copy = out / "changed"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(recordings, copy)
    parts = sorted(copy.glob("*.yaml"))
    last = parts[-1]
    # The last step with cached tokens, in the last part holding one: the
    # recording's last part replays every part before it too.
    for changed in reversed(parts):
        lines = changed.read_text().splitlines(keepends=True)
        start = lines.index("engine:\n") + 1
        found = [
            (index, match)
            for index in range(start, len(lines))
            if (match := re.search(r"cached_tokens: \{(\w+): (\d+)", lines[index]))
            and int(match.group(2)) > 0
        ]
        if found:
            index, match = found[-1]
            break
    else:
        raise SystemExit("no step with cached tokens to change")
    first_entry = _entries_before(copy, changed)
    step = first_entry + index - start
    request, value = match.group(1), int(match.group(2))
    lines[index] = lines[index].replace(
        f"cached_tokens: {{{request}: {value}", f"cached_tokens: {{{request}: {value + 128}", 1
    )
    changed.write_text("".join(lines))
    report = must(kvgate("replay", str(last), "--target", "model"), 1, "the changed copy")
    where = f"first divergence at step {step} "
    if where not in report:
        raise SystemExit(f"the changed copy did not fail at step {step}:\n{report}")
    return {
        "changed_copy": f"{changed.name}: step {step}: cached_tokens {value} -> {value + 128}, "
        f"FAIL at step {step}"
    }


def _stem(path: Path) -> str:
    """A recording part's recording: its name without the part number."""
    return path.name.rsplit(".", 2)[0]


def _followed(path: Path) -> bool:
    """A later part of the same recording follows this one."""
    number = int(path.name.rsplit(".", 2)[1])
    return (path.parent / f"{_stem(path)}.{number + 1:03d}.yaml").exists()


def _entries_before(directory: Path, path: Path) -> int:
    """Entries in the parts before `path`'s (its steps are numbered after them)."""
    total = 0
    for earlier in sorted(directory.glob("*.yaml")):
        if earlier.name < path.name and _stem(earlier) == _stem(path):
            match = re.search(r"^end: \{entries: (\d+)\}", earlier.read_text(), re.M)
            total += int(match.group(1)) if match else 0
    return total


# The page whose part `docs` fills, and the measurements it is filled from.
PAGE = Path(__file__).resolve().parent.parent / "docs" / "how-to" / "record-and-replay.md"
MEASURED = PAGE.with_name("served-e2e.json")
PART = re.compile(
    r"(<!-- generated: served-e2e -->\n)(.*?)(<!-- end generated: served-e2e -->)", re.S
)


def served_table(measured: dict[str, Any]) -> str:
    """The page's table of what the served test recorded, from its measurements."""
    sent = measured["sent"]
    cut = measured.get("killed") or {}
    rows = [
        ("served by", f"vLLM {measured['vllm_served']} (`vllm-cpu`), OpenAI server, 2 CPU cores"),
        (
            "time",
            f"engine start-up {measured['startup_seconds']:.0f} s, load "
            f"{measured['load_seconds']:.0f} s, "
            f"gating both targets {measured['gate_seconds']:.0f} s",
        ),
        (
            "requests sent",
            f"{measured['requests']} ({sent.get('chat', 0)} chat, "
            f"{sent.get('chat-stream', 0)} streamed chat, "
            f"{sent.get('chat-stream-disconnect', 0)} streamed then disconnected, "
            f"{sent.get('completion', 0)} completions; "
            f"{measured['sessions']} sessions of {measured['turns']} turns, started "
            "together, side by side"
            + (
                f"; then {measured['pressure_requests']} completions side by side that "
                "outgrow the pool)"
                if "pressure_requests" in measured
                else ")"
            ),
        ),
        ("requests recorded", str(measured["arrivals"])),
        (
            "recording",
            f"{measured['files']} files of at most {measured['max_entries']} entries, "
            f"{measured['entries']} entries, {measured['engine_steps']} engine steps",
        ),
        ("aborted inside a step", str(measured["aborted_inside_a_step"])),
        ("aborted between steps", str(measured["aborted_between_steps"])),
        ("ended by a stop condition (`stop`)", str(measured["stopped_by_a_stop_condition"])),
        ("preemptions", str(measured["preempted"])),
        ("prefix-cache resets", str(measured["resets"])),
        ("follow-ups written as continuations (`all_of`)", continuations(measured)),
        ("cached tokens reported", str(measured["prefill_cached_tokens"])),
        ("gate on the model, level strict", measured["gate_model"]),
        ("gate on vLLM 0.33.0's Scheduler, level strict", measured["gate_vllm"]),
        ("a copy with one expectation changed", measured["changed_copy"]),
    ]
    if cut:
        rows += [
            ("killed with SIGKILL after", f"{cut['load_seconds']:.0f} s of load"),
            ("where its files were cut", "; ".join(cut.get("cuts", [])) or "none"),
            (
                "requests it had sent, and recorded",
                f"{cut['requests']} sent, {cut['arrivals']} reached the engine and are recorded",
            ),
            ("its gate with --partial on vLLM 0.33.0", cut["gate_vllm"]),
        ]
    lines = ["| what | measured |", "| --- | --- |"]
    lines += [f"| {what} | {value.replace('|', '/')} |" for what, value in rows]
    return "\n".join(lines) + "\n"


def continuations(measured: dict[str, Any]) -> str:
    """How many follow-ups were written `all_of` the earlier request, of those
    whose history came back as its tokens, by kind."""
    written = str(measured["follow_ups_written_as_continuations"])
    follow_ups = measured.get("follow_ups")
    if not follow_ups:
        return written
    kinds = ", ".join(
        f"{shares} of {sent} {kind} follow-ups"
        for kind, (sent, shares) in sorted(follow_ups.items())
    )
    others = any(shares < sent for sent, shares in follow_ups.values())
    return (
        f"{written}: each follow-up whose re-sent history tokenizes to the earlier request's "
        f"prompt and output ({kinds}"
        + (
            "; the others' reply ended early or held a token the detokenizer drops)"
            if others
            else ")"
        )
    )


def fill_page() -> None:
    """Write the measured table into the page's generated part."""
    measured = json.loads(MEASURED.read_text())
    text = PAGE.read_text()
    if not PART.search(text):
        raise SystemExit(f"{PAGE}: no '<!-- generated: served-e2e -->' part")
    PAGE.write_text(PART.sub(lambda m: m.group(1) + served_table(measured) + m.group(3), text))


def docs(out: Path) -> None:
    """Keep the run's measurements (and the killed run's, if any) for the page."""
    measured = json.loads((out / "run" / "measured.json").read_text())
    killed = out / "killed" / "measured-killed.json"
    if killed.exists():
        measured["killed"] = json.loads(killed.read_text())
    elif MEASURED.exists() and "killed" in json.loads(MEASURED.read_text()):
        # No killed run this time (`--kill` is a run of its own): the last
        # one's measurements stay.
        measured["killed"] = json.loads(MEASURED.read_text())["killed"]
    MEASURED.write_text(json.dumps(measured, indent=2, sort_keys=True) + "\n")
    fill_page()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="stage", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("model", type=Path)
    s = sub.add_parser("serve")
    s.add_argument("model", type=Path)
    s.add_argument("out", type=Path)
    s.add_argument("--port", type=int, default=18431)
    s.add_argument("--blocks", type=int, default=20)
    s.add_argument("--sessions", type=int, default=6)
    s.add_argument("--turns", type=int, default=3)
    s.add_argument("--kill", action="store_true")
    c = sub.add_parser("check")
    c.add_argument("out", type=Path)
    c.add_argument("--killed", action="store_true")
    d = sub.add_parser("docs")
    d.add_argument("out", type=Path)
    args = parser.parse_args()
    if args.stage == "prepare":
        prepare(args.model)
    elif args.stage == "serve":
        serve(args.model, args.out, args.port, args.blocks, args.kill, args.sessions, args.turns)
    elif args.stage == "docs":
        docs(args.out)
    else:
        check(args.out, args.killed)


if __name__ == "__main__":
    main()
