"""Credentials never travel through the config.

Before: `${oc.env:AWS_SECRET_ACCESS_KEY}` in a recipe resolved and landed in config.json,
the workflow input and the memo. Now the interpolation is refused by name (set or not),
and so is any resolved value shaped like a credential; the error names the field and
never echoes the value.
"""

from __future__ import annotations

import textwrap

import pytest

from ratchet.config import ConfigError, load_config, validate_config

BASE = {"model": {"path": "/nowhere"}, "data": {"train_files": "/nowhere.parquet"}}
SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"


def refused(overrides: list[str] = (), *, base: dict | None = None, path=None) -> ConfigError:
    with pytest.raises(ConfigError) as excinfo:
        load_config(path, overrides, base=None if path else (base or BASE), check_files=False)
    return excinfo.value


@pytest.mark.parametrize(
    "variable", ["AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "AWS_SESSION_TOKEN", "HF_TOKEN", "WANDB_API_KEY", "DB_PASSWORD"]
)
def test_env_interpolation_of_a_credential_in_a_recipe(tmp_path, monkeypatch, variable: str) -> None:
    monkeypatch.setenv(variable, SECRET)
    recipe = tmp_path / "run.yaml"
    recipe.write_text(
        textwrap.dedent(
            f"""\
            model:
              path: /nowhere
            data:
              train_files: /nowhere.parquet
            storage:
              root: s3://bucket/${{oc.env:{variable}}}
            """
        )
    )
    err = refused(path=recipe)
    ((field, message),) = err.issues
    assert field == "storage.root"
    assert f"${{oc.env:{variable}}}" in message
    assert "credentials come from the environment of the processes that use them" in message
    assert SECRET not in str(err)


def test_interpolation_is_refused_even_when_the_variable_is_unset(monkeypatch) -> None:
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
    err = refused(["tracking.tags=['${oc.env:AWS_SECRET_ACCESS_KEY,none}']"])
    assert "tracking.tags.0" in dict(err.issues)


def test_interpolation_in_a_dict_given_to_the_client(monkeypatch) -> None:
    """Client.submit passes dicts through load_config(base=...), which resolves them too."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    err = refused(base={**BASE, "tracking": {"tags": ["${oc.env:AWS_SECRET_ACCESS_KEY}"]}})
    assert "tracking.tags.0" in dict(err.issues) and SECRET not in str(err)


def test_computed_variable_names_are_refused() -> None:
    err = refused(["tracking.name=x", "tracking.tags=['${oc.env:${tracking.name}}']"])
    assert "name it literally" in dict(err.issues)["tracking.tags.0"]


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        ("AKIAIOSFODNN7EXAMPLE", "an AWS access key id"),
        ("ASIAY34FZKBOKMUTVV7A", "an AWS access key id"),
        ("-----BEGIN RSA PRIVATE KEY-----", "a private key"),
        ("s3://admin:hunter22@bucket/runs", "a URL with a user and password"),
        ("https://host/x?X-Amz-Signature=abcdef0123456789", "a credential in a URL's query string"),
        ("ghp_" + "a1B2" * 9, "a GitHub token"),
        ("hf_" + "AbCd" * 9, "a Hugging Face token"),
        ("sk-proj-" + "xY1" * 12, "an API secret key"),
        ("xoxb-1234567890-1234567890123-AbCdEfGhIjKlMnOp", "a Slack token"),
    ],
)
def test_resolved_values_that_look_like_credentials(value: str, kind: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        validate_config({**BASE, "tracking": {"tags": ["ok", value]}}, check_files=False)
    ((field, message),) = excinfo.value.issues
    assert field == "tracking.tags.1"
    assert kind in message and value not in str(excinfo.value)


def test_the_value_of_a_credential_variable_pasted_into_the_config(monkeypatch) -> None:
    monkeypatch.setenv("MY_SERVICE_TOKEN", "Zq9vX2mL7pR4tY8w")
    err = refused(["tracking.tags=[run-Zq9vX2mL7pR4tY8w]"])
    message = dict(err.issues)["tracking.tags.0"]
    assert "the environment variable MY_SERVICE_TOKEN" in message and "Zq9vX2mL7pR4tY8w" not in str(err)


def test_credential_is_not_echoed_by_other_errors(monkeypatch) -> None:
    """A credential in a field that also fails the schema is refused first, without echo."""
    err = refused(["loop.steps=AKIAIOSFODNN7EXAMPLE"])
    assert list(dict(err.issues)) == ["loop.steps"] and "AKIAIOSFODNN7EXAMPLE" not in str(err)


@pytest.mark.parametrize(
    "override",
    ["storage.root=${oc.env:HOME}/runs", "tracking.tags=['${oc.env:PWD}']", "tracking.tags=[hf_cache, sk-1, tokenizer, sk-learn-experiments-2024-rewards]",
     "tracking.tags=['${oc.env:TOKENIZERS_PARALLELISM,false}']", "storage.root=s3://bucket/user@host"],
)  # fmt: skip
def test_harmless_values_pass(override: str) -> None:
    load_config(None, [override], base=BASE, check_files=False)
