"""A rollout engine in a process of its own beside the trainer, on the same device, with
no Ray: the trainer's weights reach it by the CUDA IPC transport's own code, and it can
sleep (give the device to the trainer) and wake up. The GPU check
(benchmarks/gpu_check.py) measures the colocated sync and hand-over with it on a machine
that has no Ray, and tests/gpu checks them; on CPU the IPC handles are shared memory, so
the same code runs in the CPU tests.

One sync, as the run's actors do it (device_sync.py), with a pipe for Ray's calls:
  this process   sync_plan + check_finite_shards + gather_and_share into a BucketRelay of
                 one receiver (IPC_WINDOW buckets ahead), each bucket flat on the device
                 and shared by handle (ipc_relay); a thread answers the engine's
                 `sync_manifest` / `sync_take` / `sync_leave` on the relay
  the engine     IpcSource (manifest, names checked, each handle opened, asking for the
                 next bucket acknowledges the last) into `HFEngine.load_weights`
"""

from __future__ import annotations

import threading
import time
import traceback
import uuid
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from .buckets import Manifest, check_names, full_tensor
from .device_sync import IpcSource, gather_and_share, ipc_relay
from .relay import BucketRelay, SyncAborted
from .trainer_side import check_finite_shards, sync_plan


@dataclass(frozen=True)
class ColocatedSync:
    """One sync into the engine process, as the trainer saw it: from the plan to the
    engine's report that every bucket is loaded."""

    bytes: int  # wire bytes the engine loaded
    buckets: int
    seconds: float
    window_peak: int  # the most buckets the trainer held shared at once

    @property
    def gb_per_s(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 1e9


@dataclass(frozen=True)
class HandOver:
    """The engine's sleep or wake-up: how long it took and what the device holds after."""

    seconds: float
    allocated_before: int  # bytes the engine's process had allocated on the device
    allocated_after: int
    device: str
    weight_bytes: int  # the engine's parameters and buffers: what a wake-up must bring back
    # (cuBLAS's workspaces, also released by sleep, come back with the next matmul)


def weights_digest(entries: list, manifest: Manifest) -> dict[str, float]:
    """Each sent tensor's sum in the wire dtype (as float32): what the engine's copy must
    sum to, exactly, after a sync (the same kernels on the same bytes)."""
    with torch.no_grad():
        return {
            spec.name: float(full_tensor(tensor).to(getattr(torch, spec.dtype)).float().sum().item())
            for spec, (_, tensor) in zip(manifest.specs, entries)
        }


class ColocatedEngine:
    """An `HFEngine` in a spawned process on this process's device (its GPU, else the CPU).

    `load` it with a model folder, then `sync_from` a trainer's model, `sleep` / `wake_up`
    it, ask it for `greedy` answers or its weights' `digest`. Every call waits at most
    `timeout_s` and raises RuntimeError with the engine process's own error."""

    def __init__(self, *, threads: int = 1, timeout_s: float = 300.0):
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")  # a forked child cannot use CUDA
        self.timeout_s = timeout_s
        self._commands, child_commands = ctx.Pipe()
        self._sync, child_sync = ctx.Pipe()
        self.process = ctx.Process(target=_engine_main, args=(child_commands, child_sync, threads), daemon=True)
        self.process.start()

    def __enter__(self) -> "ColocatedEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def load(self, model_path: str, dtype: str) -> float:
        """Serve `model_path` in `dtype` (an HFEngine); returns the seconds it took."""
        return self._ask("load", model_path, dtype)

    def sync_from(self, model: torch.nn.Module, *, engine_dtype: str, bucket_mb: float, version: int) -> ColocatedSync:
        """Load `model`'s weights (a trainer's, FSDP2-sharded or not) into the engine, by
        IPC handles on this process's device."""
        device = next(model.parameters()).device
        sync_id = uuid.uuid4().hex
        relay = ipc_relay(1, device, self.timeout_s)
        server = _RelayServer(self._sync, sync_id, relay, self.process)
        server.start()
        t0 = time.perf_counter()
        try:
            self._send("sync", sync_id)
            try:
                entries, manifest = sync_plan(model, engine_dtype=engine_dtype, bucket_mb=bucket_mb, version=version)
                check_finite_shards(entries, f"the weights of policy v{version} (to be synced)", 1)
            except Exception as e:
                relay.fail(f"{type(e).__name__}: {e}")
                raise
            relay.start(manifest)
            _, failure = gather_and_share(entries, manifest, relay)
            received = self._reply("sync")  # the engine's own error first: it is the cause
            seconds = time.perf_counter() - t0  # the trainer may go on from here; stopping the relay's thread is cleanup
            if failure is not None:
                raise failure
        finally:
            server.stop()
        return ColocatedSync(bytes=received, buckets=len(manifest.buckets), seconds=seconds, window_peak=relay.peak_stored)

    def sleep(self) -> HandOver:
        return HandOver(**self._ask("sleep"))

    def wake_up(self) -> HandOver:
        return HandOver(**self._ask("wake_up"))

    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        return self._ask("greedy", prompts, max_new_tokens)

    def digest(self) -> dict[str, float]:
        """Each of the engine's parameters' sum (float32), by name."""
        return self._ask("digest")

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self._ask("exit", timeout_s=30)
            except RuntimeError:
                pass
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()

    def _ask(self, op: str, *args, timeout_s: float | None = None):
        self._send(op, *args)
        return self._reply(op, timeout_s)

    def _send(self, op: str, *args) -> None:
        try:
            self._commands.send((op, args))
        except OSError:  # a broken pipe: the process is gone
            raise RuntimeError(f"the engine process died (exit code {self.process.exitcode}) before {op!r}") from None

    def _reply(self, op: str, timeout_s: float | None = None):
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        try:
            while not self._commands.poll(0.1):
                if not self.process.is_alive():
                    raise EOFError
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the engine process did not answer {op!r} within {timeout_s or self.timeout_s:g} s")
            status, value = self._commands.recv()
        except (EOFError, OSError):
            raise RuntimeError(f"the engine process died (exit code {self.process.exitcode}) during {op!r}") from None
        if status != "ok":
            raise RuntimeError(f"the engine process failed in {op!r}: {value}")
        return value


class _RelayServer(threading.Thread):
    """The trainer's `sync_*` methods for one sync, answered over a pipe (what Ray's calls
    to the trainer rank's concurrency group do in a run)."""

    def __init__(self, conn, sync_id: str, relay: BucketRelay, engine_process):
        super().__init__(daemon=True, name=f"relay-{sync_id[:8]}")
        self.conn, self.sync_id, self.relay, self.engine_process = conn, sync_id, relay, engine_process
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=30)

    def run(self) -> None:
        while not self._stop_event.is_set():
            if not self.engine_process.is_alive():
                self.relay.fail("the engine process died")
                return
            if not self.conn.poll(0.01):  # also how long stop() may wait for this thread
                continue
            method, args = self.conn.recv()
            try:
                self.conn.send(("ok", getattr(self, method)(*args)))
            except Exception as e:  # noqa: BLE001 - the receiver raises it as its own
                self.conn.send(("error", f"{type(e).__name__}: {e}"))

    def _check(self, sync_id: str) -> None:
        if sync_id != self.sync_id:
            raise SyncAborted(f"weight sync {sync_id} is not the one open ({self.sync_id})")

    def sync_manifest(self, sync_id: str) -> Manifest:
        self._check(sync_id)
        return self.relay.manifest()

    def sync_take(self, sync_id: str, consumer: int, index: int):
        self._check(sync_id)
        return self.relay.take(consumer, index)

    def sync_leave(self, sync_id: str, consumer: int, error: str | None = None) -> None:
        self.relay.leave(consumer)

    def sync_abort(self, sync_id: str, reason: str) -> None:
        self.relay.fail(reason)


# -- the engine process --------------------------------------------------------------------


class _PipeRank:
    """The trainer rank as the engine process reaches it: `rank.method.remote(*args)`
    sends the call over the pipe and returns its answer as a Future (protocol.call)."""

    def __init__(self, conn):
        self.conn = conn

    def __getattr__(self, method: str):
        conn = self.conn

        class _Method:
            @staticmethod
            def remote(*args) -> Future:
                conn.send((method, args))
                status, value = conn.recv()
                done: Future = Future()
                if status == "ok":
                    done.set_result(value)
                else:
                    done.set_exception(SyncAborted(value))
                return done

        return _Method


def _allocated() -> int:
    if not torch.cuda.is_available():
        return 0
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


class _EngineServer:
    def __init__(self, sync_conn):
        self.sync_conn = sync_conn
        self.engine = None

    def load(self, model_path: str, dtype: str) -> float:
        from ..engines.hf import HFEngine

        t0 = time.perf_counter()
        self.engine = None
        self.engine = HFEngine(model_path, dtype=dtype)
        _allocated()
        return time.perf_counter() - t0

    def sync(self, sync_id: str) -> int:
        model = self.engine.model
        source = IpcSource(_PipeRank(self.sync_conn), sync_id, 0)
        try:
            params = set(dict(model.named_parameters()))
            check_names(source.manifest().all_names, params, optional=set(model.state_dict()) - params, what="the synced weights")
        except BaseException as e:
            source.close(f"{type(e).__name__}: {e}")
            raise
        self.engine.load_weights(source.pairs())
        _allocated()  # every copy done before the trainer hears of it
        return int(source.nbytes)

    def _hand_over(self, move) -> dict:
        before = _allocated()
        t0 = time.perf_counter()
        move()
        after = _allocated()
        model = self.engine.model
        weight_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        return {
            "seconds": time.perf_counter() - t0, "allocated_before": before, "allocated_after": after,
            "device": self.engine.device.type, "weight_bytes": weight_bytes,
        }  # fmt: skip

    def sleep(self) -> dict:
        return self._hand_over(self.engine.sleep)

    def wake_up(self) -> dict:
        return self._hand_over(self.engine.wake_up)

    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        from ratchet.workers.engines.base import SamplingParams

        out = self.engine.generate(prompts, SamplingParams(n=1, greedy=True, max_new_tokens=max_new_tokens))
        return [group[0].token_ids for group in out]

    def digest(self) -> dict[str, float]:
        with torch.no_grad():
            return {name: float(p.float().sum().item()) for name, p in self.engine.model.named_parameters()}

    def exit(self) -> None:
        return None


def _engine_main(commands, sync_conn, threads: int) -> None:
    torch.set_num_threads(threads)
    server = _EngineServer(sync_conn)
    while True:
        op, args = commands.recv()
        try:
            commands.send(("ok", getattr(server, op)(*args)))
        except BaseException as e:  # noqa: BLE001 - reported to the trainer's side, which raises it
            commands.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"))
        if op == "exit":
            return
