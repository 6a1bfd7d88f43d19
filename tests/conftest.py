"""Shared fixtures: the shipped SmolLM2 model, loaded once per session, and its Hugging Face reference; a
throwaway Postgres server per session (``postgres_server``, ``postgres_url``)."""
from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run on the CPU interpreter
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
torch.manual_seed(0)
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)  # one core per worker: scripts/test.sh runs one worker per core


def _interpreter_scans_once() -> None:
    """Triton's CPU interpreter patches triton.language's builtins to interpreted ones at every kernel launch and
    again at every call of a @triton.jit helper inside one (a program calls several), each time listing every
    member of the language's modules with inspect.getmembers: about a quarter of an interpreted kernel test's
    time. Here each module's builtin names are listed once, before any launch, and each patch walks those names
    in the same (sorted) order, patching each member that is still a builtin, as the library's scan would: the
    same patches. A module not listed here takes the library's own scan."""
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    scan = interpreter._patch_builtin
    builtins = {pkg: [name for name, member in inspect.getmembers(pkg) if tl.core.is_builtin(member)]
                for pkg in (tl, tl.core, tl.tensor, tl.math, tl.core.tensor_descriptor_base)}

    def patch_builtin(pkg, builder, scope):
        names = builtins.get(pkg)
        if names is None:
            return scan(pkg, builder, scope)
        for name in names:
            member = getattr(pkg, name)
            if tl.core.is_builtin(member):
                interpreter._patch_attr(pkg, name, member, builder, scope)

    interpreter._patch_builtin = patch_builtin


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_scans_once()


@pytest.fixture(scope="session")
def smollm2_path():
    from engine.loader.model_source import smollm2_gguf_path

    return smollm2_gguf_path()


@pytest.fixture(scope="session")
def smollm2_engine_factory(smollm2_path):
    """Builds SmolLM2 engines with different settings, loading the weights and tokenizer once per depth.

    ``short=True``: the real weights and tokenizer of the first 8 of 30 decoder layers, for runs of dozens of
    generations (the gates, hot swaps) whose point does not need the whole stack: a step costs about a third.
    Every planted fault of tests/checks/test_gates.py shows at 8 layers as at 30 (at 6 the position-blind
    prefix hash no longer flips a token in the interleaved scenario)."""
    from engine import EngineConfig, LLMEngine, VariantSpec, resolve

    cache: dict = {}

    def make(short: bool = False, **kwargs) -> LLMEngine:
        # VariantSpec's defaults unless a test gives its own, whatever static-best is recorded for the machine
        kwargs.setdefault("variant", VariantSpec())
        layers = 8 if short else None
        cfg = EngineConfig(source=resolve("smollm2"), layers=layers, **kwargs)
        base = cache.get(layers)
        if base is None:
            base = cache[layers] = LLMEngine(EngineConfig(source=resolve("smollm2"), layers=layers, num_kv_blocks=4,
                                                          variant=VariantSpec()))
        return LLMEngine.with_loaded(base, cfg)

    return make


@pytest.fixture(scope="session")
def smollm2_short(smollm2_engine_factory):
    """The first 8 layers of SmolLM2 (``smollm2_engine_factory(short=True)``), for the gates."""
    return smollm2_engine_factory(short=True, num_kv_blocks=8)


@pytest.fixture(scope="session")
def gguf_parsed_once():
    """A context manager under which transformers parses each GGUF file once and builds each tensor-name map once.

    transformers reads a GGUF's metadata (SmolLM2's: a vocabulary of 49,152 tokens and its merges, about 10 s
    here) for the config, again for the weights and again for the tokenizer, and builds the same tensor-name
    map for each of the file's 272 tensors (14 s). Both are pure: the same reader and map give the same
    weights and tokenizer, loaded by transformers' own code."""
    import contextlib

    import gguf

    readers: dict = {}
    maps: dict = {}

    @contextlib.contextmanager
    def parsed_once():
        real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map

        def reader(path, mode="r"):
            key = (str(path), mode)
            if key not in readers:
                readers[key] = real_reader(path, mode)
            return readers[key]

        def name_map(arch, n_blocks):
            if (arch, n_blocks) not in maps:
                maps[arch, n_blocks] = real_map(arch, n_blocks)
            return maps[arch, n_blocks]

        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map

    return parsed_once


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path, gguf_parsed_once):
    from transformers import AutoModelForCausalLM

    with gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(
            str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32
        )
    return model.eval()


# The longest test files first, the longest first of all: with one worker per core (scripts/test.sh) each worker
# takes the next file when it runs out, so the long ones start at once instead of leaving one worker running them
# alone at the end while the other is idle. (pyproject.toml's --no-loadscope-reorder keeps this order: pytest-xdist
# would otherwise hand out the files with the most tests first.)
FIRST = ("pipelines/test_optimize.py", "pipelines/test_scale_out.py", "engine/test_precision.py",
         "engine/test_server.py", "checks/test_gates_bf16.py", "checks/test_gates.py", "ops/test_tune.py",
         "engine/test_variants.py", "engine/test_tensor_parallel.py", "ops/test_agents.py", "engine/test_batching.py",
         "kernels/test_triton_kernels.py", "kernels/test_triton_moe_linear.py", "engine/test_bad_input.py",
         "engine/test_red_team.py", "engine/test_speculation.py", "pipelines/test_ui.py",
         "engine/test_smollm2_reference.py", "ops/test_board.py", "ops/test_loadtest.py", "ops/test_deploy_rounds.py")


def pytest_collection_modifyitems(config, items):
    def rank(item):
        path = str(item.path)
        return next((i for i, f in enumerate(FIRST) if path.endswith(f)), len(FIRST))
    items.sort(key=rank)  # stable: each file's own order kept


def _postgres_bin() -> Path | None:
    """The folder holding initdb and pg_ctl: on PATH, else Debian's /usr/lib/postgresql/<version>/bin (the
    `postgresql` package puts them there, off PATH), newest version first."""
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl"):
        return Path(found).resolve().parent
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parts[-3])
                      if p.parts[-3].isdigit() else 0, reverse=True)
    return versions[0].parent if versions else None


@dataclasses.dataclass(frozen=True)
class PostgresServer:
    url: str  # the admin database's URL, without the password
    password: str
    stop: Callable[[], None]  # a fast shutdown (connections dropped), for tests of a database going away
    start: Callable[[], None]


@pytest.fixture(scope="session")
def postgres_server():
    """A throwaway Postgres cluster for this test session (one per xdist worker): initdb in a temporary folder,
    started on a free loopback port with password authentication, stopped and removed at the end. As root it
    runs as the `postgres` user (the server refuses root). Yields a PostgresServer: tests put the password in
    PGPASSWORD (or the board's POLYINF_BOARD_PASSWORD), as a deployment's secret would be."""
    import pwd
    import secrets as secrets_mod
    import subprocess

    from ops.release.deploy import free_port

    bindir = _postgres_bin()
    if bindir is None:
        pytest.skip("no PostgreSQL binaries (initdb, pg_ctl) found: install Debian's postgresql package "
                    "(scripts/test.sh does when run as root)")
    root = Path(tempfile.mkdtemp(prefix="polyinf-pg-"))
    prefix: list[str] = []
    if os.geteuid() == 0:
        try:
            user = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and no `postgres` user to run the server as (the postgresql package "
                        "creates it)")
        os.chown(root, user.pw_uid, user.pw_gid)
        prefix = ["runuser", "-u", "postgres", "--"]
    password = secrets_mod.token_hex(12)
    pwfile = root / "pw"
    pwfile.write_text(password)
    if prefix:
        os.chown(pwfile, pwd.getpwnam("postgres").pw_uid, -1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    data, port = root / "data", free_port()

    def run(*args):
        out = subprocess.run([*prefix, *map(str, args)], capture_output=True, text=True, env=env, cwd=root)
        if out.returncode != 0:
            raise RuntimeError(f"{args[0]} failed: {out.stdout[-1500:]}{out.stderr[-1500:]}")

    run(bindir / "initdb", "-D", data, "-U", "polyinf", "--pwfile", pwfile, "--auth", "scram-sha-256",
        "-E", "UTF8", "--locale", "C", "--no-sync")
    pwfile.unlink()
    def start():  # durability off: a test cluster never survives a crash, and fsync dominates its commit time
        run(bindir / "pg_ctl", "-D", data, "-l", root / "log", "-w", "-t", "60", "start", "-o",
            f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=off "
            "-c full_page_writes=off -c max_connections=200")

    start()
    try:
        yield PostgresServer(f"postgresql://polyinf@127.0.0.1:{port}/postgres", password,
                             lambda: run(bindir / "pg_ctl", "-D", data, "-m", "fast", "-w", "stop"), start)
    finally:
        subprocess.run([*prefix, str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
                       capture_output=True, env=env, cwd=root)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def postgres_url(postgres_server, monkeypatch, request):
    """A fresh, empty database on the session's Postgres for this test, its password in PGPASSWORD; the URL
    names no password."""
    import re

    import psycopg

    monkeypatch.setenv("PGPASSWORD", postgres_server.password)
    name = "t_" + re.sub(r"[^a-z0-9]+", "_", request.node.name.lower())[:40] + "_" + os.urandom(3).hex()
    with psycopg.connect(postgres_server.url, password=postgres_server.password, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return postgres_server.url.rsplit("/", 1)[0] + "/" + name
