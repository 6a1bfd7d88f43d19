"""Child processes for work the serving process must not trust: a scrubbed environment, a private
directory, resource limits and no network.

``run_isolated`` starts a child with an environment built from an allow-list (no API keys, tokens
or cloud credentials can reach it, whatever the parent holds), a fresh private directory as its
cwd, HOME and TMPDIR (removed afterwards), its own session (killed as a group on timeout), and its
output in files capped by RLIMIT_FSIZE. The child calls ``confine()`` first thing, before it imports
anything it will run: it moves into a new network namespace (only a downed loopback: no connection
can be opened), and sets CPU-time, address-space (on a CPU), core and open-file limits.
"""
from __future__ import annotations

import ctypes
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

# environment variables a child may inherit: what a Python, torch and Triton process needs, nothing else
SAFE_ENV = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "CUDA_VISIBLE_DEVICES", "CUDA_HOME", "LD_LIBRARY_PATH",
            "TRITON_INTERPRET", "TRITON_PTXAS_PATH", "PYTHONHASHSEED", "OMP_NUM_THREADS", "VIRTUAL_ENV")
# names of variables that hold secrets, by the conventions tools use (matched in the upper-cased name)
SECRET_MARKERS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH", "SESSION", "COOKIE",
                  "PRIVATE", "CERT")
_CLONE_NEWNET, _CLONE_NEWUSER = 0x40000000, 0x10000000
OUTPUT_LIMIT = 64 * 1024**2  # bytes a child may write to any one file, its stdout and stderr included


@dataclass(frozen=True)
class IsolatedResult:
    returncode: int | None  # None: killed at the timeout
    stdout: str  # the last 64 KiB
    stderr: str
    seconds: float

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def isolated_env(extra: dict[str, str] | None = None, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a child gets: SAFE_ENV's variables from ``environ`` (default os.environ), PYTHONPATH
    pointing at this project, and ``extra``."""
    environ = os.environ if environ is None else environ
    env = {k: environ[k] for k in SAFE_ENV if k in environ}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.update(extra or {})
    return env


def is_secret_name(name: str) -> bool:
    upper = name.upper()
    return any(m in upper for m in SECRET_MARKERS) or upper.startswith(("AWS_", "OPENAI_", "ANTHROPIC_", "HF_TOKEN"))


def without_secrets(environ: dict[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default os.environ) less every variable whose name marks a secret: for children that need
    the rest of the environment (a server this process starts), given their own secret explicitly."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if not is_secret_name(k)}


def project_env(extra: dict[str, str] | None = None, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a child that runs this project's own code (a server, a load client, a board worker):
    ``environ`` (default os.environ) without its secrets (``without_secrets``), this project's root first on
    PYTHONPATH, and ``extra`` (a secret the child is given explicitly goes there)."""
    environ = os.environ if environ is None else environ
    root = str(Path(__file__).resolve().parents[2])
    env = without_secrets(environ)
    env["PYTHONPATH"] = root + os.pathsep + environ["PYTHONPATH"] if environ.get("PYTHONPATH") else root
    env.update(extra or {})
    return env


@contextmanager
def secrets_withheld():
    """``os.environ`` without its secrets while the block runs, for starting processes that inherit it
    (multiprocessing's spawn does): they get none of them. Restored afterwards."""
    held = {k: os.environ.pop(k) for k in list(os.environ) if is_secret_name(k)}
    try:
        yield
    finally:
        os.environ.update(held)


def redact(text: str, secrets) -> str:
    """``text`` with every non-empty secret value replaced by ``[redacted]``."""
    for s in secrets:
        if s and len(s) >= 4:
            text = text.replace(s, "[redacted]")
    return text


def _tail(path: Path, limit: int = 64 * 1024) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - limit))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def run_isolated(argv: list[str], timeout_s: float, stdin_text: str = "", extra_env: dict[str, str] | None = None,
                 ) -> IsolatedResult:
    """Runs ``argv`` (a command of this project's that calls ``confine()`` first) isolated; never raises for
    what the child does: a crash is a return code, a hang is a timeout (the whole session is killed)."""
    private = Path(tempfile.mkdtemp(prefix="polyinf-isolated-"))
    env = isolated_env({"HOME": str(private), "TMPDIR": str(private), "TRITON_CACHE_DIR": str(private / "triton"),
                        "POLYINF_ISOLATED_TIMEOUT": str(int(timeout_s) + 5), **(extra_env or {})})
    out, err = private / "stdout", private / "stderr"
    t0 = time.perf_counter()
    try:
        with open(out, "wb") as fo, open(err, "wb") as fe:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=fo, stderr=fe, cwd=private, env=env,
                                    start_new_session=True, close_fds=True)
            try:
                proc.communicate(stdin_text.encode(), timeout=timeout_s)
                code: int | None = proc.returncode
            except subprocess.TimeoutExpired:
                code = None
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the child and anything it started
                except ProcessLookupError:
                    pass
                proc.wait()
        return IsolatedResult(code, _tail(out), _tail(err), time.perf_counter() - t0)
    finally:
        shutil.rmtree(private, ignore_errors=True)


def _unshare_network() -> bool:
    """Moves this process into a new network namespace; False if the kernel refuses (no privilege and no
    unprivileged user namespaces)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return False
    if libc.unshare(_CLONE_NEWNET) == 0:
        return True
    return libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) == 0


def confine(cpu_s: int | None = None, memory_bytes: int | None = None) -> dict[str, bool]:
    """Called by an isolated child before it loads anything untrusted. Returns what it could apply."""
    cpu_s = cpu_s or int(os.environ.get("POLYINF_ISOLATED_TIMEOUT", "300"))
    limits = [(resource.RLIMIT_CORE, 0), (resource.RLIMIT_CPU, cpu_s), (resource.RLIMIT_FSIZE, OUTPUT_LIMIT),
              (resource.RLIMIT_NOFILE, 1024)]
    if memory_bytes:
        limits.append((resource.RLIMIT_AS, memory_bytes))
    for which, value in limits:
        _, hard = resource.getrlimit(which)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        try:
            resource.setrlimit(which, (value, hard if which != resource.RLIMIT_CORE else value))
        except (ValueError, OSError):
            pass
    network = _unshare_network()
    if not network:
        print("polyinf isolation: no network namespace here; the child keeps the host's network", file=sys.stderr)
    return {"network_namespace": network}
