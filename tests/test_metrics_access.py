"""Who may read /metrics (--metrics-access): every setting against every caller through the real app and its key
check (in-process, no tokenizer or scheduler behind it), the setting's default and checks, and the routes that stay
open whatever the keys (the probes')."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from multidict import CIMultiDict
from yarl import URL

from pagoda.cli import build_parser
from pagoda.services.api.tenants import add_key
from pagoda.shared.config import EngineConfig, ServerConfig, add_server_args, server_config_from_args
from pagoda.shared.errors import ConfigError

OPERATOR_KEY = "sk-operator"
OPEN_ROUTES = ("/health", "/ping", "/version", "/load")  # answer without a key whatever the settings
CALLERS = ("no key", "operator", "tenant", "wrong key")


def _keys_file(folder: Path) -> tuple[Path, str]:
    """A keys file with one tenant, acme; its key."""
    path = folder / "keys.json"
    return path, add_key(path, "acme", {})[1]


Ask = tuple[str, str, Any]  # method, path (as sent, escapes kept), headers


async def _serve(tmp_path: Path, asks: list[Ask], **config: Any) -> list[tuple[int, str]]:
    """(status, body) of each (method, path, headers) asked of a fresh api process's app. Tenant acme has been
    refused once by a quota first, so that /metrics has a tenant's series to show."""
    import zmq.asyncio

    from pagoda.services.api.app import build_app
    from pagoda.services.api.server import _make_state

    context = zmq.asyncio.Context()
    state = _make_state(context, EngineConfig(), ServerConfig(runtime_dir=str(tmp_path), **config))
    state.metrics.tenant_rejected("acme", "requests")
    answers = []
    try:
        async with TestClient(TestServer(build_app(state))) as client:
            for method, path, headers in asks:
                response = await client.request(method, URL(path, encoded=True), headers=headers)
                answers.append((response.status, await response.text()))
    finally:
        await state.pool.close()
        await state.stats.close()
        context.destroy(linger=0)
    return answers


def serve(tmp_path: Path, asks: list[Ask], **config: Any) -> list[tuple[int, str]]:
    return asyncio.run(_serve(tmp_path, asks, **config))


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# (keys file, operator key, --metrics-access) -> the callers /metrics answers (the others get 401)
MATRIX = [
    (False, True, "auto", {"no key", "operator", "tenant", "wrong key"}),  # one tenant: as before, for Prometheus
    (False, True, "open", {"no key", "operator", "tenant", "wrong key"}),
    (False, True, "key", {"operator"}),
    (False, False, "auto", {"no key", "operator", "tenant", "wrong key"}),
    (False, False, "open", {"no key", "operator", "tenant", "wrong key"}),
    (True, True, "auto", {"operator"}),  # tenants: secure by default, and never a tenant's key
    (True, True, "open", {"no key", "operator", "tenant", "wrong key"}),  # the operator's choice, by name
    (True, True, "key", {"operator"}),
    (True, False, "auto", set()),  # no operator key to read it with: closed to everyone (and logged)
    (True, False, "open", {"no key", "operator", "tenant", "wrong key"}),
]


@pytest.mark.parametrize(("keys_file", "operator_key", "access", "answered"), MATRIX)
def test_who_reads_metrics(tmp_path: Path, keys_file: bool, operator_key: bool, access: str,
                           answered: set[str]) -> None:
    path, tenant_key = _keys_file(tmp_path)  # without the file in use, its key is just a wrong one
    config: dict[str, Any] = {"metrics_access": access}
    if keys_file:
        config["api_keys_file"] = str(path)
    if operator_key:
        config["api_key"] = OPERATOR_KEY
    headers = {"no key": {}, "operator": _bearer(OPERATOR_KEY), "tenant": _bearer(tenant_key),
               "wrong key": _bearer("pgk-" + "0" * 43)}
    asks = [("GET", "/metrics", headers[caller]) for caller in CALLERS]
    asks += [("GET", route, {}) for route in OPEN_ROUTES]
    asks += [("GET", "/v1/models", headers["tenant"])]
    answers = serve(tmp_path, asks, **config)
    for caller, (status, body) in zip(CALLERS, answers[:len(CALLERS)], strict=True):
        if caller in answered:
            assert status == 200, (caller, body)
            assert 'pagoda_tenant_rejections_total{reason="requests",tenant="acme"}' in body
        else:
            assert status == 401, (caller, body)
            assert "authentication_error" in body and "acme" not in body
    for route, (status, body) in zip(OPEN_ROUTES, answers[len(CALLERS):-1], strict=True):
        # /health and /ping are 503 here (no tokenizer, no scheduler): answered, not refused
        assert status in (200, 503) and "acme" not in body, (route, status, body)
    models_status = answers[-1][0]
    assert models_status == (200 if keys_file or not operator_key else 401)  # the tenant still works where it is one


def test_every_spelling_of_metrics_needs_the_key(tmp_path: Path) -> None:
    """Whatever path reaches the metrics handler (an escaped letter, a query, HEAD) is checked as /metrics is."""
    path, tenant_key = _keys_file(tmp_path)
    asks = [("GET", "/%6Detrics", {}), ("GET", "/metrics?format=prometheus", {}), ("HEAD", "/metrics", {}),
            # two Authorization headers that disagree (a proxy added one): refused, as on /v1
            ("GET", "/metrics", CIMultiDict([("Authorization", f"Bearer {OPERATOR_KEY}"),
                                             ("Authorization", f"Bearer {tenant_key}")])),
            ("GET", "/%6Detrics", _bearer(OPERATOR_KEY))]
    answers = serve(tmp_path, asks, api_keys_file=str(path), api_key=OPERATOR_KEY)
    assert [status for status, _ in answers] == [401, 401, 401, 401, 200]


def test_a_refused_scrape_is_logged_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """After an upgrade a keyless scraper or probe is refused: the api says why, once, not per scrape."""
    path, tenant_key = _keys_file(tmp_path)
    with caplog.at_level(logging.WARNING, logger="pagoda.services.api.app"):
        answers = serve(tmp_path, [("GET", "/metrics", {}), ("GET", "/metrics", _bearer(tenant_key))],
                        api_keys_file=str(path), api_key=OPERATOR_KEY)
    assert [status for status, _ in answers] == [401, 401]
    warnings = [r.getMessage() for r in caplog.records if "/metrics takes the operator's key" in r.getMessage()]
    assert len(warnings) == 1 and "--metrics-access" in warnings[0] and "/version" in warnings[0]


# ------------------------------------------------------------------ the setting


def test_default_is_open_alone_and_key_beside_a_keys_file() -> None:
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    default = server_config_from_args(parser.parse_args([]))
    assert default.metrics_access == "auto" and not default.metrics_need_key()
    assert ServerConfig(api_keys_file="keys.json").metrics_need_key()
    assert not ServerConfig(api_keys_file="keys.json", metrics_access="open").metrics_need_key()
    assert ServerConfig(api_key=OPERATOR_KEY, metrics_access="key").metrics_need_key()
    chosen = server_config_from_args(parser.parse_args(["--metrics-access", "key"]))
    assert chosen.metrics_access == "key"


def test_the_environment_variable_sets_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGODA_METRICS_ACCESS", "open")
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    assert server_config_from_args(parser.parse_args([])).metrics_access == "open"


def test_unknown_values_are_refused() -> None:
    for value in ("closed", "Key", "", "tenant"):
        with pytest.raises(ConfigError) as caught:
            ServerConfig(metrics_access=value)
        assert caught.value.param == "metrics_access"


def test_key_by_name_needs_an_operator_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        ServerConfig(metrics_access="key", api_keys_file="keys.json").check_metrics_access()
    assert caught.value.param == "metrics_access" and "--metrics-access" in caught.value.message
    assert "--api-key" in caught.value.message
    key_file = tmp_path / "operator.key"
    key_file.write_text(OPERATOR_KEY + "\n")
    ServerConfig(metrics_access="key", api_key_file=str(key_file)).check_metrics_access()
    ServerConfig(metrics_access="key", api_key=OPERATOR_KEY).check_metrics_access()
    # the default never stops a server from starting: with no operator key /metrics is closed (and logged)
    ServerConfig(api_keys_file="keys.json").check_metrics_access()
    ServerConfig(metrics_access="open", api_keys_file="keys.json").check_metrics_access()


def test_serve_and_the_api_process_refuse_key_without_an_operator_key(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["serve", "--metrics-access", "key", "--runtime-dir", str(tmp_path)])
    assert args.func(args) == 2  # before any process starts
    assert "--metrics-access key" in capsys.readouterr().err
    api = subprocess.run([sys.executable, "-m", "pagoda.services.api", "--metrics-access", "key",
                          "--runtime-dir", str(tmp_path)], capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in os.environ.items() if not k.startswith("PAGODA_")})
    assert api.returncode == 2 and "(metrics_access)" in api.stderr, api.stderr
