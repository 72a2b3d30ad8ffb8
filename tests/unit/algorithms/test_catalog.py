"""The algorithm registries and catalog: name checks, double registration, lazy entries, catalog vs implementations."""

from __future__ import annotations

import importlib
import inspect
import math

import pytest
import torch

import ratchet.algorithms as algorithms
from ratchet.algorithms import (
    ADV_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    OFF_POLICY,
    POLICY_LOSSES,
    AdvEstimator,
    register_adv_estimator,
    register_kl,
    register_loss_agg,
    register_policy_loss,
)
from ratchet.catalog.registry import Registry, decorator

torch.set_num_threads(1)


@pytest.mark.parametrize(
    ("registry", "known"),
    [
        (ADV_ESTIMATORS, ["grpo", "rloo"]),
        (POLICY_LOSSES, ["ppo_clip"]),
        (LOSS_AGGREGATIONS, ["seq-mean-token-mean", "token-mean"]),
        (KL_ESTIMATORS, ["k1", "low_var_kl"]),
    ],
)
def test_unknown_name_lists_registered_names(registry, known):
    for name in known:
        assert registry.check(name) == name
    with pytest.raises(ValueError) as err:
        registry.get("no-such-thing")
    msg = str(err.value)
    assert "no-such-thing" in msg and registry.kind in msg
    for name in registry.names():
        assert name in msg


def test_double_registration_is_rejected_and_keeps_the_first():
    before = ADV_ESTIMATORS.get("grpo")
    with pytest.raises(ValueError, match="registered twice"):
        register_adv_estimator("grpo", needs_group=False)(lambda *a: None)
    for register, name in [
        (register_policy_loss, "ppo_clip"),
        (register_loss_agg, "token-mean"),
        (register_kl, "k1"),
    ]:
        with pytest.raises(ValueError, match="registered twice"):
            register(name)(lambda *a: None)
    assert ADV_ESTIMATORS.get("grpo") is before


def test_fresh_registry_and_decorator():
    reg: Registry = Registry("widget")
    assert reg.names() == []

    @decorator(reg, "b")
    def b():
        return "b"

    def a():
        return "a"

    decorator(reg, "a", wrap=lambda fn: ("wrapped", fn))(a)
    assert b() == "b"  # the decorator returns the function unchanged
    assert reg.get("b") is b and reg.get("a") == ("wrapped", a)
    assert reg.names() == ["a", "b"]
    with pytest.raises(ValueError, match=r"unknown widget 'c'; registered: a, b"):
        reg.get("c")
    with pytest.raises(ValueError, match="widget 'a' is registered twice"):
        reg.register("a", 1)
    reg.register("c", "math:sqrt")  # a "module:attribute" entry is imported on first get
    assert reg.get("c") is math.sqrt and reg.names() == ["a", "b", "c"]


# Each kind's implementations, recognised by their parameters: a function with this signature
# in the module is an implementation, and must be listed in catalog/algorithms.py (and vice versa).
IMPLEMENTATIONS = {
    "advantage estimator": (("ratchet.algorithms.advantages", "ratchet.algorithms.advantages_outcome"), ["inputs", "params"]),
    "policy loss": (
        ("ratchet.algorithms.policy_losses", "ratchet.algorithms.policy_losses_verl", "ratchet.algorithms.policy_losses_cov"),
        ["logprob", "old_logprob", "advantages", "mask", "params"],
    ),
    "loss aggregation": ("ratchet.algorithms.aggregation", ["loss", "mask", "norm"]),
    "KL estimator": ("ratchet.algorithms.kl", ["logprob", "ref_logprob"]),
    "off-policy correction": ("ratchet.algorithms.off_policy", ["log_w", "keep", "cap"]),
}


@pytest.mark.parametrize("registry", [ADV_ESTIMATORS, POLICY_LOSSES, LOSS_AGGREGATIONS, KL_ESTIMATORS, OFF_POLICY])
def test_catalog_matches_implementations(registry):
    """The catalog's "module:function" entries and the functions in the modules are the
    same set: neither a misspelt entry nor an implementation missing from the catalog."""
    module_names, params = IMPLEMENTATIONS[registry.kind]
    module_names = (module_names,) if isinstance(module_names, str) else module_names  # a kind may span modules
    implemented = {
        f"{module_name}:{name}"
        for module_name in module_names
        for name, fn in vars(importlib.import_module(module_name)).items()
        if inspect.isfunction(fn) and fn.__module__ == module_name and list(inspect.signature(fn).parameters) == params
    }
    targets = {name: entry.impl if isinstance(entry, AdvEstimator) else entry for name, entry in registry.entries.items()}
    assert all(isinstance(t, str) and t.split(":")[0] in module_names for t in targets.values()), targets
    assert set(targets.values()) == implemented
    for name, target in targets.items():
        entry = registry.get(name)
        module_name, function = target.split(":")
        assert getattr(entry, "fn", entry) is getattr(importlib.import_module(module_name), function)


def test_every_exported_name_resolves():
    # The package imports its torch-backed names on first use, from a table of module names.
    for name in algorithms.__all__:
        assert getattr(algorithms, name) is not None, name
