"""Multi-turn tool rollouts: drive a batch of conversations in which the model may call
tools, and return them as one `RolloutBatch` (docs/multi_turn.md).

A conversation alternates model turns and tool observations inside the response:

    prompt | turn 1 (mask 1) | observation (mask 0) | turn 2 (mask 1) | ...

Each round generates one turn for every conversation still going (one engine call), looks
for tool calls in it (tools/parsing.py), runs them (each in a thread, at most its
`timeout_s`; an error or a timeout is the observation text), appends the observation's
tokens and goes on until a turn calls nothing, `max_turns` model turns were generated, or
the response budget (`rollout.max_response_length`, observations included) is spent. A
conversation always ends with a model turn: an observation nothing could follow is not
appended, so the last 1 of the response mask is the last token and attention covers the
observations before it (`RolloutBatch.attention_mask`).

Observation tokens have response_mask 0, rollout log-prob 0 (meaningless: the policy did
not sample them) and the policy version of the turn before them.

Determinism: turn 1 is sampled exactly as a single-turn rollout (the prompt's seed, `n`
samples); turn t > 1 of sample j is one sample seeded from (the prompt's seed, j, t), so a
conversation does not depend on which other conversations share an engine call, and a
retried rollout replays it token for token, provided its tools answer the same (the
calculator does; the code runner does for deterministic code; a timeout does not).

Partial rollouts: with a `weight_swap` (fully_async), weights may change between two
decode steps of a turn as in single-turn rollouts, and also between turns: the driver
offers the swap before each new turn, so a long tool call does not hold a sync back for a
whole conversation. Each token records the version that sampled it.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ratchet.tools.base import ToolOutcome, run_tool
from ratchet.tools.config import build_tools, parse_tools, parse_tools_kwargs
from ratchet.tools.parsing import CallFormat, call_format

from .batch import RolloutBatch, SampleRow
from .batch_seeds import prompt_seeds
from ratchet.workers.engines.base import Engine, Generation, SamplingParams, WeightSwap

if TYPE_CHECKING:
    from .prompts import PromptSet

log = logging.getLogger(__name__)

# Why a conversation ended (samples[i]["extra_info"]["stop_reason"]).
NO_CALL, MAX_TURNS, MAX_TOKENS = "no_call", "max_turns", "max_tokens"


def _sampled(seed: int | None) -> int:
    """A sampled conversation's prompt seed (only a greedy one has none)."""
    if seed is None:
        raise ValueError("a sampled conversation without its prompt's seed")
    return seed


def turn_seed(prompt_seed: int, sample: int, turn: int) -> int:
    """The seed of turn `turn` (>= 2) of sample `sample` of a prompt seeded `prompt_seed`."""
    import numpy as np

    state = np.random.SeedSequence([prompt_seed, sample, turn]).generate_state(1, dtype=np.uint64)[0]
    return int(state >> np.uint64(1))


@dataclass
class Conversation:
    """One sample's response as it grows: tokens, loss mask, behaviour log-probs, versions."""

    prompt_index: int
    prompt: list[int]
    seed: int | None  # the prompt's seed (None: greedy)
    sample: int
    tokens: list[int] = field(default_factory=list)
    mask: list[float] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    spans: list[dict] = field(default_factory=list)  # {"role": assistant|tool, "start", "end"} in the response
    calls: list[dict] = field(default_factory=list)
    turns: int = 0
    stop_reason: str | None = None

    def add_turn(self, gen: Generation, version: int) -> None:
        start = len(self.tokens)
        self.tokens += gen.token_ids
        self.mask += [1.0] * len(gen.token_ids)
        self.logprobs += list(gen.logprobs)
        self.versions += list(gen.versions) if gen.versions else [version] * len(gen.token_ids)
        self.spans.append({"role": "assistant", "start": start, "end": len(self.tokens)})
        self.turns += 1

    def cut_last_turn(self, keep: int) -> None:
        """Keep the last turn's first `keep` tokens (a stop-after-call format)."""
        span = self.spans[-1]
        end = span["start"] + keep
        for seq in (self.tokens, self.mask, self.logprobs, self.versions):
            del seq[end:]
        span["end"] = end

    def add_observation(self, ids: list[int]) -> None:
        start = len(self.tokens)
        version = self.versions[-1] if self.versions else 0
        self.tokens += ids
        self.mask += [0.0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [version] * len(ids)
        self.spans.append({"role": "tool", "start": start, "end": len(self.tokens)})


class MultiTurnRollout:
    """The tools, the call format and the limits of `rollout.multi_turn`; `generate_batch`
    runs a batch of conversations with an engine."""

    def __init__(
        self,
        tools: dict,
        tokenizer: Any,
        *,
        fmt: CallFormat,
        max_turns: int,
        max_tool_response_tokens: int,
        observation_template: str | None = None,
        max_response_length: int,
    ):
        self.tools = tools
        self.tokenizer = tokenizer
        self.fmt = fmt
        self.max_turns = max_turns
        self.max_tool_response_tokens = max_tool_response_tokens
        self.template = observation_template or fmt.observation_template
        self.max_response_length = max_response_length

    @classmethod
    def from_config(cls, cfg, tokenizer) -> "MultiTurnRollout | None":
        """The driver of `cfg.rollout.multi_turn` (a RunConfig), or None when it is off."""
        mt = cfg.rollout.multi_turn
        if not mt.enabled:
            return None
        # Checked at submit too (config/loader.py: tool_issues); here it can only fail when
        # this machine differs from the submitting one (a tool file missing here).
        tools = build_tools(parse_tools({"tools": mt.tools}, "rollout.multi_turn.tools"))
        return cls(
            tools,
            tokenizer,
            fmt=call_format(mt.format),
            max_turns=mt.max_turns,
            max_tool_response_tokens=mt.max_tool_response_tokens,
            observation_template=mt.observation_template,
            max_response_length=cfg.rollout.max_response_length,
        )

    def check_prompts(self, prompts: "PromptSet", path: str) -> None:
        """Every row's `extra_info.tools_kwargs` names configured tools (ValueError naming
        the file, row and field otherwise): checked once, before any generation."""
        names = frozenset(self.tools)
        for row in range(len(prompts)):
            parse_tools_kwargs(prompts.sample_info(row)["extra_info"], names, f"{path} row {row}")

    # -- a batch --------------------------------------------------------------------------

    def generate_batch(
        self,
        engine: Engine,
        prompts: "PromptSet",
        indices: list[int],
        params: SamplingParams,
        *,
        policy_version: int,
        weight_swap: WeightSwap | None = None,
    ) -> RolloutBatch:
        budget = min(params.max_new_tokens, self.max_response_length)
        params = replace(params, max_new_tokens=budget)
        if not params.greedy and params.prompt_seeds is None:  # called directly, not via rollout_batching.generate_batch
            params = replace(params, prompt_seeds=prompt_seeds(params.seed, 0, len(indices)))
        contexts = [prompts.token_ids[i] for i in indices]
        seeds = params.prompt_seeds if (params.prompt_seeds is not None and not params.greedy) else [None] * len(indices)
        groups = engine.generate(contexts, params, version=policy_version, weight_swap=weight_swap)
        version = policy_version
        convs: list[Conversation] = []
        for idx, seed, group in zip(indices, seeds, groups):
            for j, gen in enumerate(group):
                conv = Conversation(idx, list(prompts.token_ids[idx]), seed, j)
                conv.add_turn(gen, version)
                convs.append(conv)
                version = max([version, *(gen.versions or [])])
        active = self._after_turn(convs, prompts, budget)
        while active:
            if weight_swap is not None:  # a turn boundary: the natural point for a pending sync
                swapped = weight_swap()
                if swapped is not None:
                    version = swapped
            turn_params = replace(
                params,
                n=1,
                max_new_tokens=max(budget - len(c.tokens) for c in active),
                prompt_seeds=None if params.greedy else tuple(turn_seed(_sampled(c.seed), c.sample, c.turns + 1) for c in active),
            )
            gens = engine.generate([c.prompt + c.tokens for c in active], turn_params, version=version, weight_swap=weight_swap)
            for conv, group in zip(active, gens):
                gen = group[0]
                room = budget - len(conv.tokens)
                if len(gen.token_ids) > room:  # the call's budget was the largest room of any row
                    gen = Generation(gen.token_ids[:room], gen.logprobs[:room], gen.versions[:room] if gen.versions else None)
                conv.add_turn(gen, version)
                version = max([version, *(gen.versions or [])])
            active = self._after_turn(active, prompts, budget)
        return self._batch(convs, prompts)

    def _after_turn(self, convs: list[Conversation], prompts: "PromptSet", budget: int) -> list[Conversation]:
        """Parse the last turn of each conversation, run the calls, append the observations;
        the conversations that go on."""
        pending: list[tuple[Conversation, list]] = []
        for conv in convs:
            calls = self._parse_last_turn(conv)
            if not calls:
                conv.stop_reason = MAX_TOKENS if len(conv.tokens) >= budget else NO_CALL
                continue
            pending.append((conv, calls))
        outcomes = self._run_calls([(conv, call) for conv, calls in pending for call in calls], prompts)
        going = []
        for conv, calls in pending:
            texts = []
            for call in calls:
                outcome = outcomes.pop(0)
                record = {"name": call.name, "arguments": call.arguments, "turn": conv.turns}
                if outcome is None:
                    record.update(result=None, error=False, skipped=True)
                else:
                    record.update(result=outcome.text, error=outcome.error)
                    texts.append(outcome.text)
                conv.calls.append(record)
            if conv.turns >= self.max_turns:
                conv.stop_reason = MAX_TURNS
                continue
            observation = self._observation_ids(texts)
            if len(conv.tokens) + len(observation) + 1 > budget:  # no room for a turn after it
                conv.stop_reason = MAX_TOKENS
                continue
            conv.add_observation(observation)
            going.append(conv)
        return going

    def _parse_last_turn(self, conv: Conversation) -> list:
        span = conv.spans[-1]
        turn = conv.tokens[span["start"] : span["end"]]
        decode = self.tokenizer.decode
        # The first turn is read after the prompt: it may complete a call the prompt opened.
        context = decode(conv.prompt, skip_special_tokens=True) if conv.turns == 1 else ""
        text = context + decode(turn, skip_special_tokens=True)
        calls = self.fmt.find_calls(text, len(context), self.tools)
        if calls and self.fmt.stop_after_call:
            calls = calls[:1]
            wanted = calls[0].end - len(context)
            if len(text) > calls[0].end:  # text after the call: cut the turn where the call ends
                lengths = (len(decode(turn[:k], skip_special_tokens=True)) for k in range(1, len(turn) + 1))
                keep = next((k for k, n in enumerate(lengths, start=1) if n >= wanted), len(turn))
                conv.cut_last_turn(keep)
        return calls

    def _run_calls(self, work: list[tuple[Conversation, Any]], prompts: "PromptSet") -> list[ToolOutcome | None]:
        """The outcome of each call, in order (None: not run, the turn limit is reached).
        The calls of a round run side by side: one slow tool does not serialise the batch."""

        def one(item: tuple[Conversation, Any]) -> ToolOutcome | None:
            conv, call = item
            if conv.turns >= self.max_turns:
                return None
            if call.error is not None:
                return ToolOutcome(f"error: {call.error}", True)
            tool = self.tools.get(call.name)
            if tool is None:
                return ToolOutcome(f"error: unknown tool {call.name!r}; tools: {', '.join(sorted(self.tools))}", True)
            kwargs = parse_tools_kwargs(prompts.sample_info(conv.prompt_index)["extra_info"], frozenset(self.tools), "data")
            create = (kwargs.get(call.name) or {}).get("create_kwargs")
            if create and hasattr(tool, "bind"):
                tool = tool.bind(create)
            return run_tool(tool, call.arguments)

        if not work:
            return []
        with ThreadPoolExecutor(max_workers=min(8, len(work)), thread_name_prefix="tool-call") as pool:
            return list(pool.map(one, work))

    def _observation_ids(self, texts: list[str]) -> list[int]:
        """The template's text and each answer's tokens (cut to max_tool_response_tokens at
        the token level: a decode and re-encode would drop what the tokenizer cannot spell)."""
        before, _, after = self.template.partition("{result}")
        encode = lambda text: self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []  # noqa: E731
        ids: list[int] = []
        for text in texts:
            ids += encode(before) + encode(text)[: self.max_tool_response_tokens] + encode(after)
        return ids

    def _batch(self, convs: list[Conversation], prompts: "PromptSet") -> RolloutBatch:
        rows = []
        for c in convs:
            info = prompts.sample_info(c.prompt_index)
            extra = dict(info.get("extra_info") or {})
            extra.update(tool_calls=c.calls, num_turns=c.turns, stop_reason=c.stop_reason)
            sample = {**info, "extra_info": extra, "turns": c.spans}
            rows.append(SampleRow(c.prompt, c.tokens, c.logprobs, c.versions, c.prompt_index, sample, mask=c.mask))
        return RolloutBatch.pack(rows)
