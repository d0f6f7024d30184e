"""The teacher-cache job's server flags (`served_handler.server_spec`), no server needed: what a
server cannot give is refused naming the flag, a server flag needs ``--teacher-server``, and a
valid set becomes the `ServerSpec` the workers connect with (the served model defaulting to the
teacher's name, the API key travelling by its variable's name only)."""

from __future__ import annotations

import argparse

import pytest

from pipelines.teacher_cache import served_handler

URL = "http://127.0.0.1:8100"


def parse(*argv: str, samples=0, temperature=1.0, init="pretrained", override=()):
    ap = argparse.ArgumentParser()
    served_handler.add_server_args(ap)
    args = ap.parse_args(list(argv))
    args.samples, args.temperature, args.init = samples, temperature, init
    args.override = list(override)
    return served_handler.server_spec(args, name="gemma-3-270m")


def test_a_valid_server_becomes_the_spec_the_workers_connect_with(monkeypatch):
    assert parse() is None  # no server: the local teacher
    assert parse("--teacher-server", URL + "/") == served_handler.ServerSpec(URL, "gemma-3-270m")
    monkeypatch.setenv("TB_TEST_KEY", "secret")
    spec = parse("--teacher-server", URL, "--served-model", "g", "--server-timeout-s", "5",
                 "--api-key-env", "TB_TEST_KEY", "--rows-per-request", "2", "--in-flight", "3")  # fmt: skip
    assert spec == served_handler.ServerSpec(URL, "g", 5.0, "TB_TEST_KEY", 2, 3)
    assert "secret" not in repr(spec)  # the key stays in each worker's environment
    client = spec.connect()
    try:
        assert (client.api_key, client.retry_s, client.rows_per_request) == ("secret", 5.0, 2)
        assert client.retry_name == "--server-timeout-s"
    finally:
        client.close()


@pytest.mark.parametrize(
    "argv, kwargs, message",
    [
        ((), {"samples": 4}, "--samples 4: --teacher-server returns top-k log-probs, not draws"),
        ((), {"temperature": 2.0}, "--temperature 2.0: --teacher-server returns log-probs at "
         "temperature 1"),
        ((), {"init": "random"}, "--init random: --teacher-server serves saved weights"),
        ((), {"override": ["a=1"]}, "--override: --teacher-server serves saved weights"),
        (("--api-key-env", "TB_NO_SUCH_VARIABLE"), {}, "--api-key-env TB_NO_SUCH_VARIABLE: that "
         "variable is not set here"),
        (("--in-flight", "0"), {}, "--in-flight: expected > 0, got 0"),
    ],
)  # fmt: skip
def test_what_a_server_cannot_give_is_refused_by_flag(argv, kwargs, message):
    with pytest.raises(ValueError) as e:
        parse("--teacher-server", URL, *argv, **kwargs)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_server_flags_need_a_server_and_a_server_an_http_url():
    with pytest.raises(ValueError, match=r"^--served-model: only with --teacher-server URL$"):
        parse("--served-model", "g")
    with pytest.raises(ValueError, match=r"^--rows-per-request: only with --teacher-server"):
        parse("--rows-per-request", "4")
    with pytest.raises(ValueError, match=r"^--teacher-server: expected http\(s\)://host:port"):
        parse("--teacher-server", "127.0.0.1:8100")
