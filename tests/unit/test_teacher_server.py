"""`tokenbridge.commands.teacher_server` without a server: the venv check the tests rely on
(`make test` makes the venv; a test never installs it) and the server's arguments."""

from __future__ import annotations

import os

import pytest

from tokenbridge.commands import teacher_server


def test_a_missing_venv_is_refused_naming_the_command_that_makes_it(tmp_path):
    venv = tmp_path / "no-venv"
    assert not teacher_server.venv_ready(venv, cuda=False)
    with pytest.raises(
        RuntimeError, match=r"no-venv is missing .*requirements-vllm\.lock.*make test"
    ):
        teacher_server.ensure_venv(venv, cuda=False, create=False)
    assert not venv.exists()  # nothing was made
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch()
    (venv / teacher_server.STAMP).write_text("another lock's hash\n")
    assert not teacher_server.venv_ready(venv, cuda=False)  # made from another lock: stale


def test_server_args_carry_what_the_client_needs():
    args = teacher_server.server_args("m", name="t", port=1, k=32, max_model_len=64, eager=True)
    value = lambda flag: args[args.index(flag) + 1]  # noqa: E731
    assert args[:2] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert value("--dtype") == "float32" and value("--max-logprobs") == "32"
    assert "--no-enable-prefix-caching" in args and "--enforce-eager" in args
    assert value("--distributed-executor-backend") == "uni"  # no worker process of its own
    # ... which vLLM's CPU platform honours only with V1 multiprocessing off
    key = "VLLM_ENABLE_V1_MULTIPROCESSING"  # the default leaves the caller's setting alone
    assert teacher_server.server_env().get(key) == os.environ.get(key)
    assert teacher_server.server_env(single_process=True)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert "--enforce-eager" not in teacher_server.server_args(
        "m", name="t", port=1, k=32, max_model_len=64
    )
