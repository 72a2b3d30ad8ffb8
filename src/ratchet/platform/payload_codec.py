"""Every Temporal payload ratchet sends is encrypted and authenticated (AES-256-GCM) with a
key that only ratchet's own processes hold, and every payload it receives must carry it.

Why: the Temporal server (the embedded dev server, or a cluster's frontend) authenticates
nobody by itself. Whoever reaches its port could start a `TrainingWorkflow` whose
`reward.function` names a file they wrote, and the worker would import it. With this codec
the worker refuses such a start before any workflow code runs: the workflow fails with a
message that says why, and nothing of its config is used.

- The key: 32 random bytes in the file named by RATCHET_PAYLOAD_KEY_FILE, else
  `<state folder>/payload.key`, created by the first process that needs it and refused
  when others could read or change it (`payload_key`, which says how). On a cluster it is
  a Kubernetes Secret mounted at that path in the client, the worker and the codec server.
- Encoding: each payload (metadata and data) is serialized and sealed: metadata
  `encoding: binary/encrypted` and `encryption-key-id` (the first 16 hex characters of the
  key's SHA-256, so a wrong key is told apart from a forged payload), data = 12-byte
  random nonce + ciphertext + tag.
- Decoding, in ratchet's clients and workers: a payload sealed with this key opens. One
  that is not sealed at all, or whose tag fails, decodes to a *refused* payload, which the
  payload converter turns into a non-retryable `ApplicationError` when the value is read:
  a workflow started that way fails at once with that message (the SDK fails the workflow,
  not the task, for an ApplicationError raised while reading its input), a signal is
  dropped, an update or query is refused. A payload sealed with another key (its key id
  differs: a worker or client with the wrong key file) raises `PayloadKeyMismatch`
  instead, which fails the workflow *task*: Temporal retries it, and the run carries on
  once that process has the right key, rather than being failed by a misconfigured worker.
- Search attributes never go through a codec (the SDK encodes them plainly): they stay
  readable and searchable. Memos, summaries and details do, and the Temporal UI reads
  them through the codec server (`services/codec_server.py`), which only decodes.
- Failure messages and stack traces are not encrypted (the SDK's default failure
  converter): ratchet's errors name fields and paths, never secrets.

Cost: one AES-GCM seal or open of a few KB takes microseconds (an activity round trip is
~70 ms).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import temporalio.converter
from temporalio.api.common.v1 import Payload
from temporalio.exceptions import ApplicationError

from .payload_key import KEY_FILE_VAR, PayloadKey, PayloadKeyError, PayloadKeyMismatch, key_file_path, load_key

__all__ = [
    "AesGcmCodec", "KEY_FILE_VAR", "PayloadKey", "PayloadKeyError", "PayloadKeyMismatch", "RatchetPayloadConverter",
    "data_converter", "key_file_path", "load_key",
]  # fmt: skip

log = logging.getLogger(__name__)

ENCODING = b"binary/encrypted"
KEY_ID = "encryption-key-id"
REFUSED = b"binary/ratchet-refused"
REFUSED_TYPE = "PayloadNotAuthenticated"
_NONCE_BYTES = 12
# Bound into every tag: a payload sealed by another program with the same key (say a
# different format version) does not open here.
_AAD = b"ratchet temporal payload v1"


def _refused(why: str) -> Payload:
    return Payload(metadata={"encoding": REFUSED}, data=why.encode())


class AesGcmCodec(temporalio.converter.PayloadCodec):
    """Seals every payload with the key; opens only what it sealed (see the module)."""

    def __init__(self, key: PayloadKey | Path):
        """`key`, or the path of its file: read now when the file exists (a bad one is
        named at once), else created at the first payload, so a command that never sends
        or reads one (`ratchet status` with nothing running) leaves no key file behind."""
        self._path = key.path if isinstance(key, PayloadKey) else Path(key)
        self._lock = threading.Lock()
        self._key: PayloadKey | None = None
        if isinstance(key, PayloadKey):
            self._use(key)
        elif self._path.exists():
            self._use(load_key(self._path))

    def _use(self, key: PayloadKey) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self._aead = AESGCM(key.secret)
        self._key_id = key.key_id.encode()
        self._key = key

    @property
    def key(self) -> PayloadKey:
        if self._key is None:
            with self._lock:
                if self._key is None:
                    self._use(load_key(self._path))
        return self._key  # type: ignore[return-value]

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [self.seal(p) for p in payloads]

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [self.open(p) for p in payloads]

    def seal(self, payload: Payload) -> Payload:
        self.key  # noqa: B018 - loaded (or created) on first use
        nonce = os.urandom(_NONCE_BYTES)
        sealed = self._aead.encrypt(nonce, payload.SerializeToString(), _AAD)
        return Payload(metadata={"encoding": ENCODING, KEY_ID: self._key_id}, data=nonce + sealed)

    def try_open(self, payload: Payload) -> Payload | None:
        """The payload this one seals, or None when it is not sealed with this key."""
        from cryptography.exceptions import InvalidTag

        self.key  # noqa: B018 - loaded (or created) on first use
        if payload.metadata.get("encoding") != ENCODING or payload.metadata.get(KEY_ID) != self._key_id:
            return None
        data = payload.data
        try:
            return Payload.FromString(self._aead.decrypt(data[:_NONCE_BYTES], data[_NONCE_BYTES:], _AAD))
        except (InvalidTag, ValueError):
            return None

    def open(self, payload: Payload) -> Payload:
        opened = self.try_open(payload)
        if opened is not None:
            return opened
        sender_id = payload.metadata.get(KEY_ID)
        if payload.metadata.get("encoding") != ENCODING:
            return _refused(self._message("it is not encrypted: it was sent by a Temporal client without ratchet's payload key"))
        if sender_id is not None and sender_id != self._key_id:
            raise PayloadKeyMismatch(
                f"a Temporal payload is sealed with key id {sender_id.decode(errors='replace')}, but this process holds "
                f"{self.key.describe()}: give every ratchet process (clients, workers, the codec server) the same key file"
            )
        return _refused(self._message("its authentication tag does not verify: it was altered, or forged"))

    def _message(self, why: str) -> str:
        return (
            f"refused a Temporal payload not authenticated with this process's key ({self.key.describe()}): {why}. "
            "The sender does not hold the run's key; start and steer runs with ratchet's client or CLI (docs/temporal_ui.md)"
        )


class RefusedPayloadConverter(temporalio.converter.EncodingPayloadConverter):
    """Reads a refused payload (see the module) as the ApplicationError that says why."""

    @property
    def encoding(self) -> str:
        return REFUSED.decode()

    def to_payload(self, value: Any) -> Payload | None:
        return None  # never writes one

    def from_payload(self, payload: Payload, type_hint: type | None = None) -> Any:
        message = payload.data.decode(errors="replace")
        log.warning("%s", message)  # the worker's log says it too, not only the history
        raise ApplicationError(message, type=REFUSED_TYPE, non_retryable=True)


class RatchetPayloadConverter(temporalio.converter.CompositePayloadConverter):
    """The SDK's default converters, and the refused payload's."""

    def __init__(self) -> None:
        super().__init__(*temporalio.converter.DefaultPayloadConverter.default_encoding_payload_converters, RefusedPayloadConverter())


@lru_cache(maxsize=8)
def _converter(path: Path) -> temporalio.converter.DataConverter:
    return dataclasses.replace(
        temporalio.converter.default(), payload_codec=AesGcmCodec(path), payload_converter_class=RatchetPayloadConverter
    )


def data_converter(key_file: str | os.PathLike | None = None) -> temporalio.converter.DataConverter:
    """The data converter of every Temporal client (and so worker) ratchet makes: the
    key from `key_file` (default `key_file_path()`), loaded once per process."""
    return _converter(key_file_path() if key_file is None else Path(os.path.abspath(key_file)))
