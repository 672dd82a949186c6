"""The server takes the relaxation rule fields and relax_protect per request, and answers a bad
value with a 400 naming the field (SamplingParams's own checks)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from test_server_bad_input import AUTH, CHAT, JSON, chat, client, engine  # noqa: E402, F401


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"relax_rule": "fast"}, "relax_rule"),
        ({"relax_lambda": 0.0}, "relax_lambda"),
        ({"posterior_threshold": 1.5}, "posterior_threshold"),
        ({"posterior_alpha": -1.0}, "posterior_alpha"),
        ({"relax_protect": ["letters"]}, "relax_protect"),
        ({"relax_protect": ["re:("]}, "relax_protect"),
    ],
)
def test_bad_rule_fields_are_400_naming_the_field(client, extra, param):  # noqa: F811
    r = client.post(CHAT, headers={**JSON, **AUTH}, content=json.dumps(chat(**extra)).encode())
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == "invalid_value" and error["message"]


def test_rule_fields_reach_the_request(client):  # noqa: F811
    # This server does not speculate: a rule knob without relaxation is refused, naming
    # relaxed_thinking, which shows the field reached SamplingParams instead of being dropped.
    body = chat(relax_rule="lenient", relax_lambda=0.5)
    r = client.post(CHAT, headers={**JSON, **AUTH}, content=json.dumps(body).encode())
    assert r.status_code == 400 and "relaxed_thinking" in r.text
    r = client.post(
        CHAT, headers={**JSON, **AUTH}, content=json.dumps(chat(relax_protect=["digits"])).encode()
    )
    assert r.status_code == 400 and "relaxed_thinking" in r.text
