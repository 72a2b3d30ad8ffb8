"""Load a reward function named 'package.module:function' or 'path/to/file.py:function',
and find out once, from its signature, which token ids it asks for.

verl's signature `compute_score(data_source, solution_str, ground_truth, extra_info=None)`
gets text only. A function that also declares `response_ids` (the sampled tokens, as the
policy is trained on them, EOS included when sampled), `prompt_ids` (the prompt's tokens,
chat template included), or `completion_ids` (TRL's name for `response_ids`), or takes
`**kwargs` as TRL's reward functions do, gets those too, as lists of ints: a reward
defined on tokens (a length penalty in tokens, a banned token id) cannot be recovered from
`solution_str`, which is decoded without special tokens.

A cost function (`safety.cost_function`) has the reward function's contract and loads
with `load_reward_fn`; a rollout filter (`rollout.filter`) loads with `load_filter_fn`.
Both import through `import_function`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

from ratchet.user_code import UserCodeError, import_user_module

REQUIRED_PARAMS = ("data_source", "solution_str", "ground_truth")
TOKEN_PARAMS = ("response_ids", "prompt_ids", "completion_ids")


class RewardLoadError(ValueError):
    pass


@dataclass(frozen=True)
class RewardFunction:
    """A user reward function and the token-id arguments it takes (of TOKEN_PARAMS)."""

    fn: Callable[..., Any]
    token_params: tuple[str, ...] = ()

    def __call__(self, **kwargs: Any) -> Any:
        return self.fn(**kwargs)

    @classmethod
    def wrap(cls, fn: Callable[..., Any]) -> RewardFunction:
        """`fn` with its token-id parameters read from its signature (none when it has no
        inspectable signature); a RewardFunction is returned as it is."""
        if isinstance(fn, RewardFunction):
            return fn
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            return cls(fn)
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return cls(fn, TOKEN_PARAMS)
        named = [
            name for name in TOKEN_PARAMS
            if name in params and params[name].kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        ]  # fmt: skip
        return cls(fn, tuple(named))


def load_reward_fn(spec: str) -> RewardFunction:
    """Import the function and return it with the token ids it asks for; raise
    RewardLoadError saying what is wrong and how to fix it."""
    fn = import_function(spec)
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return RewardFunction.wrap(fn)
    accepts_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    missing = [p for p in REQUIRED_PARAMS if p not in params]
    if missing and not accepts_kwargs:
        raise RewardLoadError(
            f"{spec!r} lacks parameters {', '.join(missing)}; expected "
            "compute_score(data_source, solution_str, ground_truth, extra_info=None), optionally with response_ids, "
            "prompt_ids (token ids, lists of ints)"
        )
    # Anything else it requires would be missing at every call: refuse it now.
    given = {*REQUIRED_PARAMS, "extra_info", *TOKEN_PARAMS}
    unknown = [
        name for name, p in params.items()
        if name not in given and p.default is inspect.Parameter.empty
        and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]  # fmt: skip
    if unknown:
        raise RewardLoadError(
            f"{spec!r} requires parameters ratchet does not pass: {', '.join(unknown)}; it passes data_source, "
            f"solution_str, ground_truth, extra_info and, when asked for, {', '.join(TOKEN_PARAMS)}; give the others defaults"
        )
    return RewardFunction.wrap(fn)


FILTER_PARAMS = ("prompt", "response", "data_source", "extra_info")


def load_filter_fn(spec: str) -> Callable[..., Any]:
    """A rollout filter (`rollout.filter`), called as fn(prompt=, response=, data_source=,
    extra_info=); RewardLoadError when it cannot be imported or cannot take those."""
    fn = import_function(spec)
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn
    missing = [p for p in FILTER_PARAMS if p not in params]
    unknown = [
        name for name, p in params.items()
        if name not in FILTER_PARAMS and p.default is inspect.Parameter.empty
        and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]  # fmt: skip
    if missing or unknown:
        raise RewardLoadError(
            f"{spec!r} is not a rollout filter: expected fn(prompt, response, data_source, extra_info=None) -> bool | dict"
            + (f"; it lacks {', '.join(missing)}" if missing else "")
            + (f"; it requires {', '.join(unknown)}, which ratchet does not pass (give them defaults)" if unknown else "")
        )
    return fn


def import_function(spec: str) -> Callable[..., Any]:
    """The callable named 'package.module:function' or 'path/to/file.py:function';
    RewardLoadError saying what is wrong and how to fix it."""
    target, sep, fn_name = spec.rpartition(":")
    if not sep or not target or not fn_name:
        raise RewardLoadError(f"{spec!r} is not 'module:function' or 'path/to/file.py:function'")
    try:
        module = import_user_module(target, "ratchet_user_reward")
    except UserCodeError as exc:
        raise RewardLoadError(str(exc)) from exc
    fn = getattr(module, fn_name, None)
    if fn is None:
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise RewardLoadError(f"{target!r} has no function {fn_name!r}; callables there: {', '.join(public) or 'none'}")
    if not callable(fn):
        raise RewardLoadError(f"{spec!r} is not callable")
    return fn
