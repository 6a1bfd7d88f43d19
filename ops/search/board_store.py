"""Where the board lives: one SQLite file (the embedded default) or a Postgres database every worker shares.

``connect(locator)`` picks the store by what it is given: a file path (or ``:memory:``, or ``sqlite:///path``)
opens SQLite in WAL mode; a ``postgresql://`` URL opens Postgres through SQLAlchemy and psycopg. The board's
queries are written once, with ``?`` placeholders, and run on either through a transaction handle
(``Tx.one`` / ``Tx.all`` / ``Tx.run``). What differs lives here: the schema's types (Postgres's REAL is 4-byte,
too coarse for a lease's epoch seconds), how a transaction takes its locks (SQLite: BEGIN IMMEDIATE, the whole
file; Postgres: the rows a claim selects, ``FOR UPDATE SKIP LOCKED``) and whose clock times a lease (Postgres:
the server's, the one clock every pod shares).

A password in a URL never appears in a message: ``masked`` replaces it, and every error names the URL masked.
Give it in the URL or, better, through libpq's PGPASSWORD (psycopg reads it when the URL has none), so the URL
itself can be shown in run config and logs.
"""
from __future__ import annotations

import sqlite3
import time
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Iterator, Protocol

POSTGRES_SCHEMES = ("postgresql", "postgres", "postgresql+psycopg")

_SQLITE_SCHEMA = """
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    ts REAL NOT NULL,
    agent TEXT NOT NULL,
    kind TEXT NOT NULL,
    body TEXT NOT NULL,
    refs TEXT NOT NULL DEFAULT '[]'
);
CREATE TABLE IF NOT EXISTS experiments (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    search TEXT NOT NULL,
    variant_id TEXT NOT NULL,
    variant TEXT NOT NULL,
    tier TEXT NOT NULL,
    proposer TEXT NOT NULL,
    rationale TEXT NOT NULL,
    status TEXT NOT NULL,
    claim TEXT,
    worker TEXT,
    lease_until REAL,
    attempts INTEGER NOT NULL DEFAULT 0,
    error TEXT,
    created REAL NOT NULL,
    finished REAL,
    UNIQUE (search, variant_id, tier)
);
CREATE TABLE IF NOT EXISTS results (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    experiment_id INTEGER NOT NULL UNIQUE REFERENCES experiments(id),
    variant_id TEXT NOT NULL,
    tier TEXT NOT NULL,
    bench TEXT NOT NULL,
    worker TEXT NOT NULL,
    ts REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS searches (
    id TEXT PRIMARY KEY,
    config TEXT NOT NULL,
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS experiments_status ON experiments(status, id);
"""

# the same tables: 8-byte floats for times, 64-bit ids
_POSTGRES_SCHEMA = [
    """CREATE TABLE IF NOT EXISTS messages (
    id BIGSERIAL PRIMARY KEY,
    ts DOUBLE PRECISION NOT NULL,
    agent TEXT NOT NULL,
    kind TEXT NOT NULL,
    body TEXT NOT NULL,
    refs TEXT NOT NULL DEFAULT '[]'
)""",
    """CREATE TABLE IF NOT EXISTS experiments (
    id BIGSERIAL PRIMARY KEY,
    search TEXT NOT NULL,
    variant_id TEXT NOT NULL,
    variant TEXT NOT NULL,
    tier TEXT NOT NULL,
    proposer TEXT NOT NULL,
    rationale TEXT NOT NULL,
    status TEXT NOT NULL,
    claim TEXT,
    worker TEXT,
    lease_until DOUBLE PRECISION,
    attempts INTEGER NOT NULL DEFAULT 0,
    error TEXT,
    created DOUBLE PRECISION NOT NULL,
    finished DOUBLE PRECISION,
    UNIQUE (search, variant_id, tier)
)""",
    """CREATE TABLE IF NOT EXISTS results (
    id BIGSERIAL PRIMARY KEY,
    experiment_id BIGINT NOT NULL UNIQUE REFERENCES experiments(id),
    variant_id TEXT NOT NULL,
    tier TEXT NOT NULL,
    bench TEXT NOT NULL,
    worker TEXT NOT NULL,
    ts DOUBLE PRECISION NOT NULL
)""",
    """CREATE TABLE IF NOT EXISTS searches (
    id TEXT PRIMARY KEY,
    config TEXT NOT NULL,
    created DOUBLE PRECISION NOT NULL
)""",
    "CREATE INDEX IF NOT EXISTS experiments_status ON experiments(status, id)",
]
_SCHEMA_LOCK = 0x706F6C79  # the advisory lock that serializes concurrent first opens creating the tables


class BoardUnavailable(ConnectionError):
    """The board's database cannot be reached or refused the connection; the message names it (masked)."""


class Tx(Protocol):
    """Statements inside one transaction (or, for reads, one connection): ``?`` placeholders on every store."""

    def one(self, sql: str, args: tuple | list = ()) -> dict | None: ...
    def all(self, sql: str, args: tuple | list = ()) -> list[dict]: ...
    def run(self, sql: str, args: tuple | list = ()) -> int: ...  # rows changed


class Store(Protocol):
    where: str  # the locator as messages show it (a URL's password masked)
    lock_rows: str  # appended to a claim's SELECT: locks the rows it picks where the database can
    embedded: bool  # a file on this machine's disk, not a service other machines reach

    def tx(self) -> AbstractContextManager[Tx]: ...  # a write transaction, committed unless it raises
    def read(self) -> AbstractContextManager[Tx]: ...
    def now(self, tx: Tx) -> float: ...
    def close(self) -> None: ...


def is_url(locator: str) -> bool:
    return "://" in locator


def masked(locator: str) -> str:
    """``locator`` as it may be shown: a URL with its password replaced by ***; a path as it is."""
    if not is_url(locator):
        return locator
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(locator).render_as_string(hide_password=True)
    except (ArgumentError, ValueError):
        scheme, _, rest = locator.partition("://")
        return f"{scheme}://***@{rest.rpartition('@')[2]}" if "@" in rest else locator


def with_password(locator: str, password: str) -> str:
    """A Postgres URL with ``password`` put in (unless it holds one); anything else as it is."""
    if not password or not is_url(locator) or locator.partition("://")[0].lower() not in POSTGRES_SCHEMES:
        return locator
    from sqlalchemy.engine import make_url

    url = make_url(locator)
    return locator if url.password else url.set(password=password).render_as_string(hide_password=False)


def connect(locator: str | Path) -> Store:
    """The store ``locator`` names: a ``postgresql://`` URL, else a SQLite file (``sqlite:///path`` or a path)."""
    locator = str(locator)
    if not locator:
        raise ValueError("board: no location given; give a SQLite file path or a postgresql:// URL")
    if not is_url(locator):
        return SqliteStore(locator)
    scheme = locator.partition("://")[0].lower()
    if scheme in POSTGRES_SCHEMES:
        return PostgresStore(locator)
    if scheme == "sqlite":
        return SqliteStore(locator.partition("://")[2].removeprefix("/") or ":memory:")
    raise ValueError(f"board {masked(locator)}: unsupported scheme {scheme!r}; give a SQLite file path or a "
                     f"{' / '.join(s + '://' for s in POSTGRES_SCHEMES)} URL")


class _SqliteTx:
    def __init__(self, db: sqlite3.Connection):
        self.db = db

    def one(self, sql, args=()):
        row = self.db.execute(sql, args).fetchone()
        return None if row is None else dict(row)

    def all(self, sql, args=()):
        return [dict(r) for r in self.db.execute(sql, args).fetchall()]

    def run(self, sql, args=()):
        return self.db.execute(sql, args).rowcount


class SqliteStore:
    """One SQLite file in WAL mode: readers never block the writer, and BEGIN IMMEDIATE takes the write lock
    up front, so claim and complete never race. One connection per Board (SQLite's are not shared)."""

    lock_rows = ""
    embedded = True

    def __init__(self, path: str):
        self.where = path
        try:
            if path != ":memory:":
                Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(path, timeout=30.0, isolation_level=None, check_same_thread=False)
            self._db.row_factory = sqlite3.Row
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA busy_timeout=30000")
            self._db.executescript(_SQLITE_SCHEMA)
        except (sqlite3.Error, OSError) as e:
            raise BoardUnavailable(f"cannot open the board's SQLite file {path}: {e}") from None

    @contextmanager
    def tx(self) -> Iterator[Tx]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield _SqliteTx(self._db)
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    @contextmanager
    def read(self) -> Iterator[Tx]:
        yield _SqliteTx(self._db)

    def now(self, tx: Tx) -> float:
        return time.time()

    def close(self) -> None:
        self._db.close()


class _PostgresTx:
    def __init__(self, conn):
        self.conn = conn

    def _exec(self, sql, args):
        return self.conn.exec_driver_sql(sql.replace("?", "%s"), tuple(args))

    def one(self, sql, args=()):
        row = self._exec(sql, args).mappings().fetchone()
        return None if row is None else dict(row)

    def all(self, sql, args=()):
        return [dict(r) for r in self._exec(sql, args).mappings().fetchall()]

    def run(self, sql, args=()):
        return self._exec(sql, args).rowcount


class PostgresStore:
    """A Postgres database (the Dagster chart's, or any) through SQLAlchemy and psycopg, READ COMMITTED.

    A claim locks the row it picks (``FOR UPDATE SKIP LOCKED``: concurrent claimers skip it instead of waiting,
    and a row another claimer just took no longer matches when rechecked); completing, failing and renewing are
    conditional UPDATEs on the claim token. Each transaction checks a pooled connection out, pinged first, so a
    board outlives a database restart."""

    lock_rows = " FOR UPDATE SKIP LOCKED"
    embedded = False

    def __init__(self, url: str):
        from sqlalchemy import create_engine
        from sqlalchemy.engine import make_url
        from sqlalchemy.exc import ArgumentError

        self.where = masked(url)
        try:
            parsed = make_url(url)
        except (ArgumentError, ValueError) as e:
            raise ValueError(f"board {self.where}: not a valid database URL ({e})") from None
        if not parsed.host and not parsed.query.get("host"):
            raise ValueError(f"board {self.where}: the URL names no host (postgresql://user@host:port/database)")
        self._secret = parsed.password or ""
        self._engine = create_engine(parsed.set(drivername="postgresql+psycopg"), pool_size=1, max_overflow=4,
                                     pool_pre_ping=True, connect_args={"connect_timeout": 10},
                                     hide_parameters=True)
        with self.tx() as tx:
            tx.one("SELECT pg_advisory_xact_lock(?)", (_SCHEMA_LOCK,))
            for statement in _POSTGRES_SCHEMA:
                tx.run(statement)

    def _unavailable(self, e: Exception) -> BoardUnavailable:
        reason = str(getattr(e, "orig", None) or e).strip().splitlines()[0]
        if self._secret:
            reason = reason.replace(self._secret, "***")
        return BoardUnavailable(f"cannot reach the board's database at {self.where}: {reason}")

    @contextmanager
    def _connection(self, begin: bool):
        from sqlalchemy.exc import InterfaceError, OperationalError

        try:
            conn = self._engine.connect()
        except (OperationalError, InterfaceError) as e:
            raise self._unavailable(e) from None
        try:
            if begin:
                with conn.begin():
                    yield _PostgresTx(conn)
            else:
                yield _PostgresTx(conn)
        except (OperationalError, InterfaceError) as e:
            if not e.connection_invalidated:  # the statement's own failure, on a live connection
                raise
            raise self._unavailable(e) from None
        finally:
            conn.close()

    def tx(self):
        return self._connection(begin=True)

    def read(self):
        return self._connection(begin=False)

    def now(self, tx: Tx) -> float:
        """The server's clock: workers on different machines time leases by one clock."""
        return float(tx.one("SELECT CAST(extract(epoch FROM clock_timestamp()) AS DOUBLE PRECISION) AS t")["t"])

    def close(self) -> None:
        self._engine.dispose()
