"""A request as the manager sees it: tokens, their prefix keys, progress."""

from __future__ import annotations

from collections.abc import Sequence

from kvgate.vocabulary.tokens import NO_INPUTS, HashInputs, extend_prefix_keys, prefix_keys


class Request:
    def __init__(
        self,
        request_id: str,
        prompt: list[int],
        hash_unit: int,
        hash_lookahead: int = 0,
        inputs: HashInputs = NO_INPUTS,
        known_keys: Sequence[str] = (),
        *,
        owned: bool = False,
    ) -> None:
        """`known_keys`: the keys of a prefix of `prompt` already derived
        under the same `inputs` (see `copied_keys`); only the rest is hashed.
        `owned`: `prompt` is a fresh list the caller hands over, kept as is
        (a long prompt is not copied again); otherwise it is copied."""
        self.request_id = request_id
        # Salt, adapter, multimodal items: they enter every key as in vLLM.
        self.inputs = inputs
        self.prompt = prompt if owned else list(prompt)
        self.output: list[int] = []
        self.all_token_ids = list(prompt)
        self.hash_unit = hash_unit
        self.hash_lookahead = hash_lookahead
        # keys[i] names the prefix all_token_ids[: (i + 1) * hash_unit] under
        # `inputs`, once the `hash_lookahead` tokens after it (which it
        # covers too) exist.
        self.keys: list[str] = list(known_keys)
        extend_prefix_keys(self.keys, self.all_token_ids, hash_unit, hash_lookahead, inputs)
        # Every key derived from the tokens as they are now: false once a
        # session's chunk kept a key whose lookahead tokens it replaced,
        # until `rehash`.
        self.keys_match_tokens = True
        # Times the prompt or the keys changed other than by keys appended
        # (cut, derived again, a session's chunk): a prompt tail found keyed
        # stays keyed while this count and the pool's dropped keys stand.
        self.keys_rewritten = 0
        self.num_computed_tokens = 0
        # Its tokens a batch still in flight computes (async scheduling): the
        # release of skipped blocks counts only the processed ones.
        self.num_in_flight_tokens = 0
        self.spec_token_ids: list[int] = []
        # The junction of the request's last lookup (0: none), as the
        # scheduler stores it; the split, sparse retention and a prefill
        # checkpoint's keying read it.
        self.shared_prefix_boundary = 0
        self.num_preemptions = 0  # the hit stats count a re-admission apart
        # Never reads the prefix cache (prompt logprobs, pooling): its lookups
        # hit nothing and the hit stats leave it out; its states are cached.
        self.skip_reading_prefix_cache = False

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt)

    def append_output(self, tokens: list[int]) -> None:
        self.output.extend(tokens)
        self.all_token_ids.extend(tokens)
        extend_prefix_keys(
            self.keys, self.all_token_ids, self.hash_unit, self.hash_lookahead, self.inputs
        )

    def truncate_output(self, kept: int) -> None:
        """Keep only the first `kept` output tokens, and the keys of the
        prefixes they still complete (a scheduled run undone before it ran)."""
        del self.all_token_ids[len(self.prompt) + kept :]
        del self.output[kept:]
        complete = max(0, (len(self.all_token_ids) - self.hash_lookahead) // self.hash_unit)
        del self.keys[complete:]
        self.keys_rewritten += 1

    def continue_session(self, tokens: list[int]) -> None:
        """A streaming-input session's next input chunk, as vLLM's Scheduler
        takes it: the last sampled token (never computed) dropped with the
        keys its block would cover, the other output folded into the prompt,
        then `tokens` appended to it and keyed."""
        keep = self.num_tokens - 1
        assert keep >= self.num_computed_tokens, "the kept tokens cover the computed ones"
        kept_output = self.all_token_ids[len(self.prompt) : keep]
        del self.all_token_ids[keep:]
        del self.keys[keep // self.hash_unit :]
        self.keys_rewritten += 1
        if self.hash_lookahead:
            self.keys_match_tokens = False
        self.output.clear()
        self.prompt += kept_output + tokens
        self.all_token_ids += tokens
        extend_prefix_keys(
            self.keys, self.all_token_ids, self.hash_unit, self.hash_lookahead, self.inputs
        )

    def rehash(self) -> None:
        """Every key derived again from the tokens: a key kept over a
        session's chunk may cover, in its lookahead tokens, the sampled token
        the chunk dropped (vLLM recomputes a session's hashes before its
        lookup when they cover lookahead tokens)."""
        self.keys = prefix_keys(
            self.all_token_ids, self.hash_unit, self.hash_lookahead, self.inputs
        )
        self.keys_match_tokens = True
        self.keys_rewritten += 1

    def copied_keys(self, num_tokens: int, inputs: HashInputs) -> list[str]:
        """This request's keys that a prompt starting with its first
        `num_tokens` tokens, under `inputs`, has too: the same tokens under
        the same inputs name the same prefixes, so each key whose hashed
        window (its unit and the lookahead after it) lies in those tokens.
        Empty when a key may not match its tokens, or the inputs differ."""
        if not self.keys_match_tokens or inputs != self.inputs:
            return []
        return self.keys[: max(0, (num_tokens - self.hash_lookahead) // self.hash_unit)]
