"""Tenants: API keys (only their SHA-256 kept at rest) naming a tenant and its quotas, enforced per api process.

The keys file (JSON, written by `pagoda keys add`, reloaded when it changes or on SIGHUP):

    {"tenants": {"acme": {"models": ["*"], "max_concurrent": 16, "requests_per_minute": 600,
                          "tokens_per_minute": 200000, "priority": 0, "weight": 1.0}},
     "keys": [{"id": "3f9c0a1b", "sha256": "<hex digest of the key>", "tenant": "acme", "created": "..."}]}

Quotas (0: no limit): concurrent generation requests; requests and tokens per minute as token buckets that
hold a minute's worth and refill continuously. Tokens (prompt + completion) are charged as they come (the prompt
once admitted, the completion as it streams), so the requests a tenant has in flight may overdraw; while its token
bucket is below zero its requests get 429. `priority` is a tier (lower tiers are scheduled first) and `weight` its
share of the running slots within a tier: both travel with each request to the scheduler
(services/scheduler/fairness.py).
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import json
import logging
import math
import os
import secrets
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pagoda.services.api.errors import RateLimitError
from pagoda.shared.errors import ConfigError

log = logging.getLogger(__name__)

KEY_PREFIX = "pgk-"
TENANT_FIELDS = ("models", "max_concurrent", "requests_per_minute", "tokens_per_minute", "priority", "weight")
MAX_TENANT_CHARS = 128  # also the scheduler's bound (services/scheduler/fairness.py)
MAX_PRIORITY = 1 << 20
MIN_WEIGHT, MAX_WEIGHT = 1e-3, 1e6


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    models: tuple[str, ...] = ("*",)  # served model names this tenant may use; "*": any
    max_concurrent: int = 0
    requests_per_minute: int = 0
    tokens_per_minute: int = 0
    priority: int = 0  # tier: lower is scheduled first
    weight: float = 1.0  # share of the running slots among tenants of its tier

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        del out["name"]
        out["models"] = list(self.models)
        return out


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def tenant_cache_salt(tenant: str, cache_salt: str) -> str:
    """--prefix-cache-isolation tenant: the cache_salt a tenant's request carries to the scheduler, one digest of
    its tenant and of the salt its client sent ("" for none). Whatever salt a client sends, it cannot name another
    tenant's chain; within a tenant, clients' own salts still keep requests apart."""
    digest = hashlib.blake2b(json.dumps([tenant, cache_salt]).encode("ascii"), digest_size=16)
    return "tenant:" + digest.hexdigest()


def parse_tenant(name: str, spec: Any) -> Tenant:
    """One tenant entry of the keys file; ConfigError names what is wrong."""
    where = f"tenant {name!r}"
    if not isinstance(name, str) or not 0 < len(name) <= MAX_TENANT_CHARS:
        raise ConfigError(f"{where}: a tenant name is 1 to {MAX_TENANT_CHARS} characters", param="api_keys_file")
    if not name.isprintable() or name != name.strip():
        # the name labels metrics, the usage log and the console: "acme " would be another tenant than "acme"
        raise ConfigError(f"{where}: a tenant name holds no control character and no space at either end",
                          param="api_keys_file")
    if not isinstance(spec, dict) or set(spec) - set(TENANT_FIELDS):
        raise ConfigError(f"{where}: an object with fields among {', '.join(TENANT_FIELDS)}", param="api_keys_file")
    models = spec.get("models", ["*"])
    if not isinstance(models, list) or not models or not all(isinstance(m, str) and m for m in models):
        raise ConfigError(f"{where}: models is a non-empty list of model names (or [\"*\"])", param="api_keys_file")
    counts = {}
    for field_name in ("max_concurrent", "requests_per_minute", "tokens_per_minute"):
        value = spec.get(field_name, 0)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 40:
            raise ConfigError(f"{where}: {field_name} is an integer >= 0 (0: no limit)", param="api_keys_file")
        counts[field_name] = value
    priority = spec.get("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool) or abs(priority) > MAX_PRIORITY:
        raise ConfigError(f"{where}: priority is an integer in [-{MAX_PRIORITY}, {MAX_PRIORITY}]",
                          param="api_keys_file")
    weight = spec.get("weight", 1.0)
    if not isinstance(weight, int | float) or isinstance(weight, bool) or not MIN_WEIGHT <= weight <= MAX_WEIGHT:
        raise ConfigError(f"{where}: weight is a number in [{MIN_WEIGHT:g}, {MAX_WEIGHT:g}]", param="api_keys_file")
    return Tenant(name, tuple(models), priority=priority, weight=float(weight), **counts)


def parse_keys(data: Any) -> dict[str, tuple[str, Tenant]]:
    """The keys file's content as {sha256 hex: (key id, tenant)}."""
    return parse_document(data)[1]


def parse_document(data: Any) -> tuple[dict[str, Tenant], dict[str, tuple[str, Tenant]]]:
    """The keys file's content: its tenants by name (those no key names too: `default` may be the operator's
    alone) and its keys as {sha256 hex: (key id, tenant)}."""
    if not isinstance(data, dict) or set(data) - {"tenants", "keys"}:
        raise ConfigError("the keys file is a JSON object with 'tenants' and 'keys'", param="api_keys_file")
    tenants_spec = data.get("tenants", {})
    if not isinstance(tenants_spec, dict):
        raise ConfigError("'tenants' maps tenant names to their limits", param="api_keys_file")
    tenants = {name: parse_tenant(name, spec) for name, spec in tenants_spec.items()}
    keys = data.get("keys", [])
    if not isinstance(keys, list):
        raise ConfigError("'keys' is a list of {id, sha256, tenant}", param="api_keys_file")
    table: dict[str, tuple[str, Tenant]] = {}
    for entry in keys:
        if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str) \
                or len(entry["sha256"]) != 64 or not all(c in "0123456789abcdef" for c in entry["sha256"]):
            raise ConfigError("each key is {id, sha256 (64 lowercase hex digits), tenant}", param="api_keys_file")
        name = entry.get("tenant")
        tenant = tenants.get(name) if isinstance(name, str) else None  # a list or an object is no name (unhashable)
        if tenant is None:
            raise ConfigError(f"key {entry.get('id')!r} names tenant {name!r}, which 'tenants' does not define",
                              param="api_keys_file")
        if entry["sha256"] in table:  # one key for two tenants (or twice): which one it serves is not for us to pick
            raise ConfigError(f"key {entry.get('id')!r}: its sha256 appears twice", param="api_keys_file")
        table[entry["sha256"]] = (entry_id(entry), tenant)
    return tenants, table


def entry_id(entry: dict[str, Any]) -> str:
    """A key entry's id: the one the file gives (a non-empty string), else its digest's first 8 digits. The server
    logs it (the usage log's key_id) and `pagoda keys` lists and revokes by it: one rule for all three."""
    if "id" not in entry:
        return entry["sha256"][:8]
    if not isinstance(entry["id"], str) or not entry["id"]:
        raise ConfigError(f"key {entry['sha256'][:8]}...: its id is {entry['id']!r}, not a non-empty string "
                          "(or leave id out: its sha256's first 8 digits)", param="api_keys_file")
    return entry["id"]


def read_keys_file(path: str | Path) -> dict[str, tuple[str, Tenant]]:
    return read_document(path)[1]


def read_document(path: str | Path) -> tuple[dict[str, Tenant], dict[str, tuple[str, Tenant]]]:
    """The keys file's tenants and keys (parse_document); ConfigError if it does not load."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the keys file {path}: {exc}", param="api_keys_file") from exc
    return parse_document(parse_json(text, path))


class _NamedTwice(Exception):
    def __init__(self, name: str) -> None:
        self.name = name


def _unique_members(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's members, refusing a name given twice (json keeps the last one: a tenant pasted twice, or a
    limit, would lose the first without a word)."""
    members: dict[str, Any] = {}
    for name, value in pairs:
        if name in members:
            raise _NamedTwice(name)
        members[name] = value
    return members


def parse_json(text: str, path: str | Path) -> Any:
    """The keys file's text as JSON; ConfigError if it is not JSON or an object in it names a member twice."""
    try:
        return json.loads(text, object_pairs_hook=_unique_members)
    except _NamedTwice as exc:
        raise ConfigError(f"the keys file {path} gives {exc.name!r} twice in one object (JSON would keep only the "
                          "last): give it once", param="api_keys_file") from None
    except (ValueError, RecursionError) as exc:  # RecursionError: arrays nested thousands deep
        raise ConfigError(f"the keys file {path} is not JSON: {exc}", param="api_keys_file") from exc


# --------------------------------------------------------------------------------------------
# the file, as `pagoda keys` edits it


def load_document(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {"tenants": {}, "keys": []}
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"the keys file {path} is not JSON: {exc}", param="api_keys_file") from exc
    data = parse_json(text, path)
    parse_keys(data)  # refuse to edit a file that would not load
    return data


def save_document(path: Path, data: dict[str, Any]) -> None:
    """Write atomically (a reader never sees half a file), readable by the owner only."""
    parse_keys(data)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as out:
            json.dump(data, out, indent=2)
            out.write("\n")
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def editing(path: Path) -> Iterator[None]:
    """Held while `pagoda keys` reads, changes and writes the file back: two edits at once (two `keys add` in a
    script) would otherwise both read the old file, and the second write would drop the first one's key. The lock
    is a file beside it (the keys file itself is replaced on every write)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def add_key(path: Path, tenant: str, limits: dict[str, Any]) -> tuple[str, str]:
    """Make a key for `tenant` (created with `limits`, or its limits updated with those given); returns (key id,
    key). The key itself is stored nowhere: only its SHA-256."""
    with editing(path):
        return _add_key(path, tenant, limits)


def _add_key(path: Path, tenant: str, limits: dict[str, Any]) -> tuple[str, str]:
    data = load_document(path)
    spec = {**data["tenants"].get(tenant, {}), **limits}
    data["tenants"][tenant] = parse_tenant(tenant, spec).to_json()
    used = {entry_id(entry) for entry in data["keys"]}
    key = new_key()
    while hash_key(key)[:8] in used:  # an id names one key: revoking by it must not take another with it
        key = new_key()
    digest = hash_key(key)
    key_id = digest[:8]
    data["keys"].append({"id": key_id, "sha256": digest, "tenant": tenant,
                         "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")})
    save_document(path, data)
    return key_id, key


def revoke_key(path: Path, key_id: str) -> bool:
    """Remove the key of that id (or sha256); False if there is none. An id that several keys share (written by
    hand) removes none of them: ConfigError, asking for the sha256 of the one meant."""
    with editing(path):
        return _revoke_key(path, key_id)


def _revoke_key(path: Path, key_id: str) -> bool:
    data = load_document(path)
    named = [key_id in (entry_id(entry), entry["sha256"]) for entry in data["keys"]]
    if not any(named):
        return False
    if sum(named) > 1:
        tenants = sorted({entry["tenant"] for entry, hit in zip(data["keys"], named, strict=True) if hit})
        raise ConfigError(f"key id {key_id!r} names {sum(named)} keys (of tenants {', '.join(tenants)}): none "
                          "revoked; give the sha256 of the one to revoke, as the file shows it", param="key_id")
    kept = [entry for entry, hit in zip(data["keys"], named, strict=True) if not hit]
    data["keys"] = kept
    save_document(path, data)
    return True


# --------------------------------------------------------------------------------------------
# the keys an api process serves, and their quotas


class KeyTable:
    """The keys file as loaded, reloaded when it changes (`maybe_reload`, polled) or on demand (SIGHUP).
    A file that fails to load leaves the keys as they were."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self._signature: tuple[int, int, int] | None = None
        self.keys: dict[str, tuple[str, Tenant]] = {}
        self.tenants: dict[str, Tenant] = {}
        self.reload(at_start=True)

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def reload(self, at_start: bool = False) -> bool:
        """Load the file now; False (logged) if it does not load and the old keys stay. Raises (ConfigError) only
        `at_start`: later, a file that is gone or broken, even beside no keys at all, must not end the polling."""
        signature = self._stat()
        try:
            tenants, keys = read_document(self.path)
        except Exception as exc:  # not only ConfigError: whatever the file holds, the old keys stay and polling goes on
            error = exc if isinstance(exc, ConfigError) else ConfigError(
                f"the keys file {self.path} does not load: {type(exc).__name__}: {exc}", param="api_keys_file")
            if at_start:
                raise error from exc  # at start-up a broken file is the operator's error to see at once
            log.error("keys file not reloaded (the previous keys stay): %s", error.message)
            self._signature = signature
            return False
        self.keys, self.tenants, self._signature = keys, tenants, signature
        log.info("keys file loaded: %d key(s), %d tenant(s)", len(keys), len(tenants))
        return True

    def maybe_reload(self) -> bool:
        """Reload if the file changed since it was last read; True if it did and loaded."""
        if self._stat() == self._signature:
            return False
        return self.reload()

    def lookup(self, key: str) -> tuple[str, Tenant] | None:
        return self.keys.get(hash_key(key))

    def tenant(self, name: str) -> Tenant | None:
        """The tenant of that name, as the file defines it, whether or not a key names it (None: not defined)."""
        return self.tenants.get(name)


@dataclass(slots=True)
class Bucket:
    """A token bucket: `capacity` a minute's worth, refilled at capacity / 60 per second; it may go below 0."""

    capacity: float
    level: float
    updated_at: float

    def refill(self, now: float) -> None:
        rate = self.capacity / 60.0
        self.level = min(self.capacity, self.level + (now - self.updated_at) * rate)
        self.updated_at = now

    def seconds_until(self, level: float) -> float:
        """Seconds until the level reaches `level` (after a refill at the current time)."""
        return max(0.0, (level - self.level) * 60.0 / self.capacity)


@dataclass(slots=True)
class Usage:
    """A tenant's live state in this api process."""

    in_flight: int = 0
    requests: Bucket | None = None
    tokens: Bucket | None = None


@dataclass(slots=True)
class Lease:
    """One admitted request: charged its tokens as they come, given back when it ends."""

    tenant: Tenant
    released: bool = False
    num_charged: int = 0  # tokens charged to the tenant's bucket so far


@dataclass(slots=True)
class QuotaGate:
    """Admission against a tenant's quotas. Pure: the caller passes the clock."""

    usage: dict[str, Usage] = field(default_factory=dict)

    def _usage(self, tenant: Tenant, now: float) -> Usage:
        usage = self.usage.get(tenant.name)
        if usage is None:
            usage = self.usage[tenant.name] = Usage()
        # limits follow the file: a changed quota rebuilds its bucket (full), a removed one drops it
        usage.requests = _rebucket(usage.requests, tenant.requests_per_minute, now)
        usage.tokens = _rebucket(usage.tokens, tenant.tokens_per_minute, now)
        return usage

    def admit(self, tenant: Tenant, now: float) -> Lease:
        """A lease, or RateLimitError (429) naming the quota and when to retry."""
        usage = self._usage(tenant, now)
        if tenant.max_concurrent and usage.in_flight >= tenant.max_concurrent:
            raise RateLimitError(f"tenant {tenant.name!r} has {usage.in_flight} requests in flight, its limit "
                                 f"(max_concurrent {tenant.max_concurrent})", "requests", 1,
                                 code="concurrency_limit_exceeded")
        if usage.tokens is not None:
            usage.tokens.refill(now)
            if usage.tokens.level < 0:
                wait = usage.tokens.seconds_until(0.0)
                raise RateLimitError(f"tenant {tenant.name!r} used its {tenant.tokens_per_minute} tokens per minute",
                                     "tokens", math.ceil(wait))
        self._take_request(tenant, usage, now)
        usage.in_flight += 1
        return Lease(tenant)

    def admit_utility(self, tenant: Tenant, now: float) -> None:
        """A tokenizer route's request (/tokenize, count_tokens, ...): it takes one of the tenant's requests per
        minute (it makes the shared tokenizers work), or RateLimitError; no lease, no tokens."""
        self._take_request(tenant, self._usage(tenant, now), now)

    def _take_request(self, tenant: Tenant, usage: Usage, now: float) -> None:
        if usage.requests is None:
            return
        usage.requests.refill(now)
        if usage.requests.level < 1:
            wait = usage.requests.seconds_until(1.0)
            raise RateLimitError(f"tenant {tenant.name!r} used its {tenant.requests_per_minute} requests per minute",
                                 "requests", math.ceil(wait))
        usage.requests.level -= 1

    def charge(self, lease: Lease, num_tokens: int, now: float) -> None:
        """The request has used `num_tokens` so far (prompt + completion, a running total): the bucket is charged
        what it was not yet, so that a long request's tokens count while it runs (its tenant's next requests are
        refused once the bucket is below zero, not only after it ends)."""
        usage = self.usage.get(lease.tenant.name)
        if lease.released or usage is None or num_tokens <= lease.num_charged:
            return
        if usage.tokens is not None:
            usage.tokens.refill(now)
            usage.tokens.level -= num_tokens - lease.num_charged
        lease.num_charged = num_tokens

    def release(self, lease: Lease, num_tokens: int, now: float) -> None:
        """The request ended having used `num_tokens` in all: what was not charged yet is charged now, and what was
        charged beyond it is given back (a prompt charged once accepted, then refused by the engine)."""
        if lease.released:
            return
        usage = self.usage.get(lease.tenant.name)
        if num_tokens < lease.num_charged and usage is not None and usage.tokens is not None:
            usage.tokens.refill(now)
            usage.tokens.level = min(usage.tokens.capacity, usage.tokens.level + lease.num_charged - num_tokens)
            lease.num_charged = num_tokens
        self.charge(lease, num_tokens, now)
        lease.released = True
        if usage is None:
            return
        usage.in_flight -= 1
        assert usage.in_flight >= 0


def _rebucket(bucket: Bucket | None, per_minute: int, now: float) -> Bucket | None:
    if per_minute <= 0:
        return None
    if bucket is None or bucket.capacity != per_minute:
        return Bucket(float(per_minute), float(per_minute), now)
    return bucket


class UsageLog:
    """Append-only JSON lines, one per finished generation request (billing). O_APPEND: several api processes
    may share the file; each line is written with one write()."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, separators=(",", ":")) + "\n"
        try:
            os.write(self._fd, line.encode())
        except OSError as exc:  # a full disk must not fail the request that was already served
            log.error("usage log write failed: %s", exc)

    def close(self) -> None:
        os.close(self._fd)
