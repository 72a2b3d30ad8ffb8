"""Refuse credentials in a run configuration.

A config travels to `config.json` in the run folder, to the Temporal workflow input (kept
in its history) and to the workflow memo, where anyone with access to the store or the
Temporal UI reads it. Credentials therefore come from the environment of the processes
that use them (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN` for the
object store), never through the config.

Two checks: the recipe as written (an `${oc.env:VAR}` whose VAR names a credential is
refused before it is resolved), and every resolved string (a value shaped like a known
kind of credential, or equal to the value of a credential variable of this process).
Messages name the field and the kind of credential, never the value.

Kept free of `ratchet.storage` on purpose: importing it imports torch, and validating a
config must stay cheap.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from typing import Any

Issue = tuple[str, str]

FIX = (
    "credentials come from the environment of the processes that use them (AWS_ACCESS_KEY_ID, "
    "AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN for storage), never through the config, which is stored "
    "in config.json and in Temporal's history; remove it and set the variable where the workers run"
)

# Words that make a variable name a credential, matched against its `_`-separated parts.
_SECRET_WORDS = {
    "SECRET", "SECRETS", "TOKEN", "TOKENS", "PASSWORD", "PASSWORDS", "PASSWD", "PASS", "PASSPHRASE",
    "CREDENTIAL", "CREDENTIALS", "CREDS", "AUTH", "APIKEY", "KEY", "KEYS", "PRIVATE", "COOKIE", "SIGNATURE",
}  # fmt: skip
# ...also when a part ends with one (HFTOKEN, OPENAIAPIKEY, DBPASSWORD); not any *KEY (MONKEY).
_SECRET_ENDINGS = ("SECRET", "TOKEN", "PASSWORD", "PASSWD", "APIKEY", "ACCESSKEY", "SECRETKEY", "PRIVATEKEY")
# A name ending so says where a credential lives or how it is used, which is no secret:
# SSH_KEY_PATH, GOOGLE_APPLICATION_CREDENTIALS_FILE, SSH_AUTH_SOCK, TOKEN_DIR, RAY_AUTH_MODE.
# A URL is allowed here because the value check below still refuses one with a password.
# Deliberately not PWD among the words: `${oc.env:PWD}` is the working directory.
_HARMLESS_ENDINGS = ("PATH", "FILE", "DIR", "HOME", "SOCK", "MODE", "TYPE", "URL", "ENDPOINT")

_ENV_INTERPOLATION = re.compile(r"\$\{\s*oc\.env\s*:\s*([^,}]*)")

# (kind, pattern, random): a `random` match must mix upper and lower case, as generated
# tokens do, so that an ordinary lower-case name such as `sk-learn-experiments-2024` passes.
_SHAPES: tuple[tuple[str, re.Pattern[str], bool], ...] = (
    ("an AWS access key id", re.compile(r"\b(?:AKIA|ASIA|ABIA|ACCA)[A-Z0-9]{16}\b"), False),
    ("a private key", re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----"), False),
    ("a URL with a user and password", re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*:[^/\s@]+@"), False),
    (
        "a credential in a URL's query string",
        re.compile(r"[?&](?:access_token|token|api[_-]?key|key|secret|password|x-amz-signature|x-amz-credential|sig)=[^&\s]{8,}", re.I),
        False,
    ),
    ("a GitHub token", re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,})"), True),
    ("a Hugging Face token", re.compile(r"\bhf_[A-Za-z0-9]{30,}"), True),
    ("an API secret key (sk-...)", re.compile(r"\bsk-[A-Za-z0-9_-]{20,}"), True),
    ("a Slack token", re.compile(r"\bxox[abposr]-[0-9]+-[A-Za-z0-9-]{8,}"), False),
    ("a GitLab token", re.compile(r"\bglpat-[A-Za-z0-9_-]{20,}"), True),
    ("a Google API key", re.compile(r"\bAIza[0-9A-Za-z_-]{35}"), False),
    ("a JSON web token", re.compile(r"\beyJ[A-Za-z0-9_-]{10,}\.eyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}"), False),
)


def looks_like_credential_name(name: str) -> bool:
    """True for variable names such as AWS_SECRET_ACCESS_KEY, HF_TOKEN or DB_PASSWORD."""
    parts = [p for p in re.split(r"[^A-Z0-9]+", name.upper()) if p]
    if not parts or parts[-1] in _HARMLESS_ENDINGS:
        return False
    return any(p in _SECRET_WORDS or p.endswith(_SECRET_ENDINGS) for p in parts)


def credential_kind(text: str) -> str | None:
    """What kind of credential `text` holds ("a GitHub token", ...), or None."""
    for kind, pattern, random in _SHAPES:
        for match in pattern.finditer(text):
            token = match.group(0)
            if not random or (any(c.isupper() for c in token) and any(c.islower() for c in token)):
                return kind
    for name, value in os.environ.items():
        if _random_looking(value) and looks_like_credential_name(name) and value in text:
            return f"the value of the environment variable {name}"
    return None


def _random_looking(value: str) -> bool:
    """Short or plain values ("true", "disabled") would match ordinary text; keys are long and mixed."""
    return len(value) >= 16 and not any(c.isspace() for c in value) and any(c.isdigit() for c in value) and any(c.isalpha() for c in value)


def check_interpolations(tree: Any) -> list[Issue]:
    """Issues for `${oc.env:VAR}` interpolations of credential variables in the unresolved tree."""
    issues: list[Issue] = []
    for path, text in _strings(tree):
        for raw in _ENV_INTERPOLATION.findall(text):
            name = raw.strip().strip("'\"")
            if looks_like_credential_name(name):
                issues.append((path, f"reads the credential variable {name} through ${{oc.env:{name}}}; {FIX}"))
            elif "${" in raw:
                issues.append((path, f"builds the name of an environment variable from an interpolation ({text!r}); name it literally"))
    return issues


def check_values(data: Any) -> list[Issue]:
    """Issues for resolved strings that hold a credential (the value itself is never echoed)."""
    issues: list[Issue] = []
    for path, text in _strings(data):
        kind = credential_kind(text)
        if kind is not None:
            issues.append((path, f"holds what looks like {kind}; {FIX}"))
    return issues


def _strings(node: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """(dotted path, string) for every string in a tree of mappings and lists, keys included."""
    if isinstance(node, str):
        yield path or "(config)", node
    elif isinstance(node, Mapping):
        for key, value in node.items():
            child = f"{path}.{key}" if path else str(key)
            if isinstance(key, str):
                yield from _strings(key, child)
            yield from _strings(value, child)
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            yield from _strings(value, f"{path}.{i}" if path else str(i))
