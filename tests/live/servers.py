"""Start and stop real vLLM servers (CPU build) as subprocesses for the live tests.

- `VllmServer` runs `python -m vllm.entrypoints.openai.api_server` in its own process group with
  its own log file, waits for `/health`, and stops the whole group (SIGTERM, then SIGKILL).
- `start_all` starts several servers at once and waits for all (on 2 cores a P/D pair takes
  about a minute, three servers about two), failing with the tail of the log of any server
  that died or never became healthy.
- `RouterProcess` runs the real `kvplane router` in front of a prefill and a decode server, and
  `pd_cluster` starts the cluster every live module uses (prefill and decode with the
  connector, a plain reference server, the router on demand), module-scoped by its caller.
- `PdClient` plays the router's part of the request contract (docs/notes/live-protocol.md):
  pull (prefill, then decode with prefill's params), push (both legs at once, one transfer id)
  and reuse (prefill gets the previous turn's retained handle). Completions API with token ids
  in and out, temperature 0.

Settings that matter on this machine (docs/notes/live-on-cpu.md): float32 (bf16 hit an AMX illegal
instruction in a P/D decode worker), `VLLM_CPU_KVCACHE_SPACE=1`, `--enforce-eager`, one side
channel port per server, `HF_HUB_OFFLINE=1`. Prefix caching is off unless a server asks for it
(`prefix_caching=True`, vLLM's default): with it, prefill's recorded block ledger sees blocks
shared between requests. The handle key reaches the connectors and the router through
`$KVPLANE_HANDLE_KEY`, never through a command line.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Self

import httpx

MODEL_NAME = "tiny"


def require_vllm() -> None:
    """Fail (never skip) when vLLM's CPU build is not importable here, saying how to fix it."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("vllm") is None:
        pytest.fail("vLLM is not installed in this interpreter: the live connector tests run "
                    "real vLLM servers and are never skipped. Run `make setup-live` (or "
                    "`bash scripts/install_live.sh .venv`) and use that venv's python.",
                    pytrace=False)


KEEP_LOG_DIRS = 60  # the newest suites' folders kept: a developer's disk does not fill up
CREATED_LOG_DIRS: list[Path] = []  # this session's, newest last (conftest shows a failed
# test's log tails from them: CI keeps only the test output)


def log_dir(suite: str) -> Path:
    """Where a suite's server logs and event database go: kept after the run (pytest's own
    temporary folders are rotated away by later runs), under $KVPLANE_TEST_LOGS or the
    temporary folder. Only the newest KEEP_LOG_DIRS folders stay: older ones are removed here
    (each run's logs and stores take tens of MiB, and test runs add up)."""
    import shutil
    import tempfile

    base = Path(os.environ.get("KVPLANE_TEST_LOGS",
                               Path(tempfile.gettempdir()) / "kvplane-live-logs"))
    path = base / f"{suite}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    path.mkdir(parents=True, exist_ok=True)
    CREATED_LOG_DIRS.append(path)
    old = sorted((p for p in base.iterdir() if p.is_dir() and p != path),
                 key=lambda p: p.stat().st_mtime)
    for stale in old[:max(0, len(old) - KEEP_LOG_DIRS + 1)]:
        shutil.rmtree(stale, ignore_errors=True)
    return path


_HANDED_OUT: set[int] = set()


def _ephemeral_low() -> int:
    """The lowest port the kernel gives an outgoing connection (Linux's default: 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port nothing listens on, below the kernel's ephemeral range, not handed out before
    in this process. Not port 0's pick: that comes from the ephemeral range, and in the seconds
    before a vLLM server binds it, any outgoing connection (the engines' own, NIXL's, HTTP
    clients') may take it as its local port; a decode server's side channel then failed with
    "Address already in use" (2 Dec, back-to-back live-prediction runs)."""
    low = _ephemeral_low()
    top = low if low > 21000 else 65535
    rng = random.SystemRandom()
    for _ in range(500):
        port = rng.randrange(20000, top)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free port in 20000-{top} after 500 tries")


@dataclass
class VllmServer:
    name: str
    model: Path
    log_dir: Path
    connector: dict[str, Any] | None = None  # kv_connector_extra_config; None: no connector
    port: int = field(default_factory=free_port)
    side_port: int = field(default_factory=free_port)
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    prefix_caching: bool = False
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}.log"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(self.model), "--served-model-name", MODEL_NAME,
               "--host", "127.0.0.1", "--port", str(self.port),
               "--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
               "--max-num-seqs", "4", "--block-size", "32",
               "--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching",
               *self.extra_args]
        if self.connector is not None:
            extra = {"instance": self.name, "side_channel_port": self.side_port,
                     **self.connector}
            cmd += ["--kv-transfer-config", json.dumps({
                "kv_connector": "KvplaneConnector",
                "kv_connector_module_path": "kvplane.live.connector",
                "kv_role": "kv_both", "kv_buffer_device": "cpu",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": extra})]
        return cmd

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.side_port),
               "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
               "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
               "VLLM_LOGGING_LEVEL": "INFO", "PYTHONUNBUFFERED": "1", **self.env}
        log = open(self.log_path, "ab")  # noqa: SIM115 - closed with the process
        log.write(f"$ {' '.join(self.command())}\n".encode())
        log.flush()
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"vLLM server {self.name} exited with "
                                   f"{self.proc.returncode if self.proc else '?'}:\n"
                                   f"{self.log_tail()}")
            if self.healthy():
                return
            time.sleep(1.0)
        raise RuntimeError(f"vLLM server {self.name} not healthy after {timeout:.0f} s:\n"
                           f"{self.log_tail()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)

    def kill(self) -> None:
        """SIGKILL the whole process group at once (a crash, for fault tests)."""
        self.stop(signal.SIGKILL, timeout=10)

    def metrics(self) -> dict[str, float]:
        """`/metrics` as {name{labels}: value}, summed over engines."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            name, _, value = line.rpartition(" ")
            try:
                out[name] = out.get(name, 0.0) + float(value)
            except ValueError:
                continue
        return out

    def metric(self, prefix: str, **labels: str) -> float:
        """Sum of every sample whose name starts with `prefix` and has the given labels."""
        total = 0.0
        for key, value in self.metrics().items():
            name = key.split("{", 1)[0]
            if name != prefix:
                continue
            if all(f'{k}="{v}"' in key for k, v in labels.items()):
                total += value
        return total


def start_all(servers: list[VllmServer], timeout: float = 420.0) -> None:
    for s in servers:
        s.start()
    try:
        with cf.ThreadPoolExecutor(len(servers)) as pool:
            for f in [pool.submit(s.wait_ready, timeout) for s in servers]:
                f.result()
    except BaseException:
        stop_all(servers)
        raise


def stop_all(servers: list[VllmServer]) -> None:
    threads = [threading.Thread(target=s.stop) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


# ---- the router's part, for the tests -----------------------------------------------------------


@dataclass
class Completion:
    token_ids: list[int]
    text: str
    kv_transfer_params: dict[str, Any] | None
    raw: dict[str, Any]


def complete(url: str, prompt: list[int], max_tokens: int,
             kv_transfer_params: dict[str, Any] | None = None, *,
             request_id: str | None = None, timeout: float = 120.0) -> Completion:
    body: dict[str, Any] = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
                            "stream": False}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    headers = {"X-Request-Id": request_id} if request_id else {}
    r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=timeout)
    r.raise_for_status()
    data = r.json()
    choice = data["choices"][0]
    return Completion(list(choice.get("token_ids") or []), choice.get("text", ""),
                      data.get("kv_transfer_params"), data)


@dataclass
class PdClient:
    """The router's side of the contract, minimal: one prefill, one decode."""

    prefill: VllmServer
    decode: VllmServer

    def prefill_source(self) -> dict[str, Any]:
        return {"instance": self.prefill.name, "host": "127.0.0.1",
                "port": self.prefill.side_port}

    def pull(self, prompt: list[int], max_tokens: int, *, retain: bool = False,
             retain_ttl: float | None = None, reuse: dict[str, Any] | None = None,
             xfer: str | None = None, attempt: int = 0) -> tuple[Completion, Completion]:
        """Prefill's leg, then decode's with prefill's answer. `attempt` > 0 is the router's
        retry of an exchange (the same transfer id, the next attempt)."""
        xfer = xfer or f"pull-{uuid.uuid4().hex[:12]}"
        kp: dict[str, Any] = {"v": 1, "mode": "pull", "xfer": xfer, "attempt": attempt}
        if reuse is not None:
            kp["reuse"] = reuse
        p = complete(self.prefill.url, prompt, 1, {"do_remote_decode": True, "kvplane": kp},
                     request_id=xfer)
        params = p.kv_transfer_params
        assert params and params.get("kvplane"), f"prefill returned no kvplane params: {p.raw}"
        params["kvplane"]["retain"] = retain
        if retain_ttl is not None:
            params["kvplane"]["retain_ttl"] = retain_ttl
        d = complete(self.decode.url, prompt, max_tokens, params, request_id=xfer)
        return p, d

    def push(self, prompt: list[int], max_tokens: int, *, retain: bool = False,
             retain_ttl: float | None = None, reuse: dict[str, Any] | None = None,
             xfer: str | None = None, order: str = "together",
             lead: float = 0.5, attempt: int = 0) -> tuple[Completion, Completion]:
        """Both legs, sharing one transfer id. `order`: "together" (both at once),
        "registration_first" (decode's leg `lead` seconds ahead), "prefill_first" (prefill's
        leg answered before decode's is sent: prefill holds its blocks for the registration)."""
        xfer = xfer or f"push-{uuid.uuid4().hex[:12]}"
        pk: dict[str, Any] = {"v": 1, "mode": "push", "xfer": xfer, "attempt": attempt}
        if reuse is not None:
            pk["reuse"] = reuse
        dk: dict[str, Any] = {"v": 1, "mode": "push", "xfer": xfer, "attempt": attempt,
                              "source": self.prefill_source(), "retain": retain}
        if retain_ttl is not None:
            dk["retain_ttl"] = retain_ttl
        p_params = {"do_remote_decode": True, "kvplane": pk}
        d_params = {"do_remote_prefill": True, "kvplane": dk}
        if order == "prefill_first":
            p = complete(self.prefill.url, prompt, 1, p_params, request_id=xfer)
            return p, complete(self.decode.url, prompt, max_tokens, d_params, request_id=xfer)
        with cf.ThreadPoolExecutor(2) as pool:
            fd = pool.submit(complete, self.decode.url, prompt, max_tokens, d_params,
                             request_id=xfer)
            if order == "registration_first":
                time.sleep(lead)
            fp = pool.submit(complete, self.prefill.url, prompt, 1, p_params, request_id=xfer)
            return fp.result(), fd.result()


# ---- the router, as a process -------------------------------------------------------------------


def kvplane_command() -> str:
    """The `kvplane` entry point of the interpreter running the tests: its venv's bin/, else
    the one on PATH (an install with `pip install --target DIR` puts it in DIR/bin, as the GPU
    scripts do)."""
    import shutil

    import pytest

    path = Path(sys.executable).parent / "kvplane"
    found = str(path) if path.exists() else shutil.which("kvplane")
    if found is None:
        pytest.fail(f"no `kvplane` command next to {sys.executable} or on PATH: install the "
                    "project into this venv (pip install -e '.[live]')", pytrace=False)
    return found


@dataclass
class RouterProcess:
    """`kvplane router` in front of one prefill and one decode, recording into the run."""

    prefill: VllmServer
    decode: VllmServer
    db: Path
    run: str
    log_dir: Path
    handle_key: str = ""
    port: int = field(default_factory=free_port)
    mode: str | None = None
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self, mode: str) -> list[str]:
        def spec(s: VllmServer) -> str:
            return f"{s.url},id={s.name},side=127.0.0.1:{s.side_port}"

        return [kvplane_command(), "router", "--prefill", spec(self.prefill),
                "--decode", spec(self.decode), "--mode", mode,
                "--host", "127.0.0.1", "--port", str(self.port),
                "--db", str(self.db), "--run-id", self.run,
                "--lease-ttl", "120", "--heartbeat-every", "2", "--log-level", "INFO"]

    def start(self, mode: str, timeout: float = 60.0) -> None:
        assert self.proc is None, "router already running"
        self.starts += 1
        log = open(self.log_dir / f"router-{self.starts}-{mode}.log", "wb")  # noqa: SIM115
        cmd = self.command(mode)
        log.write(f"$ {' '.join(cmd)}\n".encode())
        log.flush()
        env = {**os.environ, "KVPLANE_HANDLE_KEY": self.handle_key, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.mode = mode
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}:\n"
                                   f"{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"router not healthy after {timeout:.0f} s:\n"
                                   f"{self.log_tail()}")
            time.sleep(0.2)

    def log_tail(self, lines: int = 40) -> str:
        path = self.log_dir / f"router-{self.starts}-{self.mode}.log"
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """SIGTERM: aiohttp's clean shutdown (the recorder flushes); SIGKILL: a crash."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.proc = None

    def use(self, mode: str) -> str:
        """The router's URL, running in `mode` (restarted if it ran another one)."""
        if self.mode != mode or self.proc is None or self.proc.poll() is not None:
            self.stop()
            self.start(mode)
        return self.url

    def health(self) -> dict[str, Any]:
        return dict(httpx.get(f"{self.url}/health", timeout=10).json())

    def metric(self, name: str, **labels: str) -> float:
        total = 0.0
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line.startswith("#") or not line:
                continue
            key, _, value = line.rpartition(" ")
            if key.split("{", 1)[0] == name and all(f'{k}="{v}"' in key
                                                     for k, v in labels.items()):
                total += float(value)
        return total


# ---- the cluster the live modules share -----------------------------------------------------------


@dataclass(frozen=True)
class Side:
    """The flags of one server of a cluster: prefix caching (vLLM's default is on), extra vLLM
    arguments (`--max-num-batched-tokens 64` for chunked prefill, `--num-gpu-blocks-override 24`
    for a KV cache small enough to preempt) and extra environment."""

    prefix_caching: bool = False
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()


@dataclass
class PdCluster:
    """A prefill and a decode server with KvplaneConnector, a plain reference server (no
    connector; None when a module needs none), any further servers with the connector
    (`extra`, by name), and the router in front of the pair (started on first use), all
    recording into one run."""

    prefill: VllmServer
    decode: VllmServer
    single: VllmServer | None
    router: RouterProcess
    db: Path
    run: str
    logs: Path
    extra: dict[str, VllmServer] = field(default_factory=dict)

    @property
    def plain(self) -> VllmServer:
        assert self.single is not None, "this cluster has no plain reference server"
        return self.single

    @property
    def servers(self) -> list[VllmServer]:
        return [self.prefill, self.decode, *([self.single] if self.single else []),
                *self.extra.values()]

    @property
    def client(self) -> PdClient:
        return PdClient(self.prefill, self.decode)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        stop_cluster(self)

    def reference(self, prompt: list[int], max_tokens: int) -> list[int]:
        """The plain server's greedy tokens for `prompt`."""
        return complete(self.plain.url, prompt, max_tokens).token_ids

    def events(self, settle: float = 0.6) -> list[Any]:
        """Everything the connectors and the router recorded so far, merged by time."""
        from kvplane.store import open_store

        time.sleep(settle)  # the connectors write every 0.2 s, the router every 0.5 s
        with open_store(str(self.db)) as store:
            out = list(store.events(self.run))
        return sorted(out, key=lambda e: e.at)

    def of(self, xfer: str, settle: float = 0.6) -> list[Any]:
        return [e for e in self.events(settle) if e.request == xfer]

    def wait_for(self, xfer: str, kind: type, timeout: float = 20.0,
                 **match: object) -> list[Any]:
        """The events of one exchange, once one of `kind` (matching) is among them."""
        return wait_events(lambda: self.of(xfer, settle=0.2), kind, timeout, **match)


def pd_cluster(suite: str, connector: dict[str, Any], *, handle_key: str = "",
               prefix_caching: bool = False, prefill: Side | None = None,
               decode: Side | None = None, plain: Side | None = Side(),
               common: Side = Side(), extra: tuple[str, ...] = (),
               model: Path | None = None, server: type[VllmServer] | None = None,
               timeout: float = 420.0) -> PdCluster:
    """Start the shared cluster; `with pd_cluster(...) as c:` stops it at the end.

    `connector`: kv_connector_extra_config of the servers with the connector (the event store
    and run are added). `prefill` / `decode`: their flags (default: `prefix_caching` on both);
    `plain`: the reference server's (None: no reference); `common`: arguments and environment
    for every server; `extra`: names of further servers with the connector and the prefill's
    flags; `model`: the model folder (default: tiny_model.py's); `server`: a VllmServer subclass
    (the GPU suite's sets device flags)."""
    import uuid

    require_vllm()
    model = model or _tiny_model().tiny_model_dir()
    kind = server or VllmServer
    logs = log_dir(suite)
    db = logs / "events.db"
    run = f"{suite}-{uuid.uuid4().hex[:8]}"
    cfg = {"kvplane_db": str(db), "kvplane_run": run, **connector}
    keyed = {"KVPLANE_HANDLE_KEY": handle_key} if handle_key else {}
    prefill = prefill or Side(prefix_caching=prefix_caching)
    decode = decode or Side(prefix_caching=prefix_caching)

    def make(name: str, side: Side, with_connector: bool) -> VllmServer:
        env = {**dict(common.env), **dict(side.env), **(keyed if with_connector else {})}
        return kind(name, model, logs, connector=dict(cfg) if with_connector else None,
                    env=env, extra_args=[*common.args, *side.args],
                    prefix_caching=side.prefix_caching)

    p, d = make("prefill", prefill, True), make("decode", decode, True)
    single = make("single", plain, False) if plain is not None else None
    more = {name: make(name, prefill, True) for name in extra}
    start_all([p, d, *([single] if single else []), *more.values()], timeout=timeout)
    print(f"\nvLLM and router logs and events in {logs}")
    return PdCluster(p, d, single, RouterProcess(p, d, db, run, logs, handle_key=handle_key),
                     db, run, logs, more)


def stream_completion(client: httpx.Client, url: str, toks: list[int], max_tokens: int,
                      conversation: str | None = None) -> tuple[str, list[int], float, float]:
    """One streamed greedy completion of token ids at `url` (a router or an engine): (the
    answer's X-Request-Id, "" without one; the output token ids; TTFT and TPOT in seconds,
    from the request's start). A status other than 200 raises with the body's start."""
    body: dict[str, Any] = {"model": MODEL_NAME, "prompt": toks, "max_tokens": max_tokens,
                            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
                            "stream": True}
    if conversation is not None:
        body["conversation_id"] = conversation
    ids: list[int] = []
    first = last = 0.0
    t0 = time.perf_counter()
    with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
        rid = r.headers.get("x-request-id", "")
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            obj = json.loads(line[5:])
            got = [t for c in obj.get("choices") or [] for t in c.get("token_ids") or []]
            if got:
                last = time.perf_counter()
                first = first or last
                ids += got
    ttft = first - t0 if ids else 0.0
    tpot = (last - first) / (len(ids) - 1) if len(ids) > 1 else 0.0
    return rid, ids, ttft, tpot


def only(evs: list[Any], kind: type, **match: object) -> list[Any]:
    """The events of `kind` whose fields equal `match`."""
    return [e for e in evs if isinstance(e, kind)
            and all(getattr(e, k) == v for k, v in match.items())]


def wait_events(read: Callable[[], list[Any]], kind: type, timeout: float = 20.0,
                **match: object) -> list[Any]:
    """`read()`'s events once one of `kind` (matching) is among them, else after `timeout`
    seconds, for the assertion to show what was there (recorders write in batches)."""
    deadline = time.monotonic() + timeout
    while True:
        evs = read()
        if only(evs, kind, **match) or time.monotonic() > deadline:
            return evs
        time.sleep(0.3)


def recorded(db: Path, run: str, xfer: str) -> list[Any]:
    """One exchange's events in the store, in recorded order."""
    from kvplane.store import open_store

    with open_store(str(db)) as store:
        return [e for e in store.events(run) if e.request == xfer]


def settled(read: Callable[[], float], want: float, what: str = "metric",
            timeout: float = 20.0) -> float:
    """`read()` once it equals `want` (vLLM publishes its counters a little after the
    request); asserts with its last value after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        got = read()
        if got == want or time.monotonic() > deadline:
            assert got == want, f"{what} is {got}, expected {want}"
            return got
        time.sleep(0.5)


def prompt(seed: int, n: int = 150) -> list[int]:
    """`n` token ids drawn from `seed`: a prompt no other seed repeats, inside the tiny model's
    vocabulary and clear of its special ids."""
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


def helper(name: str, path: Path | None = None) -> ModuleType:
    """A helper module of the live tests (`name.py` next to this file, or `path`), loaded once
    under the name `kvplane_live_<name>` (`kvplane_gpu_live` for the GPU suite), which no other
    test folder can shadow: test folders are not packages here. tests/live/conftest.py loads
    them all before any test module, which then imports them by those names."""
    import importlib.util

    full = "kvplane_gpu_live" if name == "gpu_live" else f"kvplane_live_{name}"
    if full not in sys.modules:
        where = path or Path(__file__).with_name(f"{name}.py")
        spec = importlib.util.spec_from_file_location(full, where)
        assert spec is not None and spec.loader is not None
        sys.modules[full] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[full]


def _tiny_model() -> Any:
    return helper("tiny_model")


def stop_cluster(c: PdCluster) -> None:
    c.router.stop()
    stop_all(c.servers)
