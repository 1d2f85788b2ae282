"""``data.engine_options``: a mapping checked against the typed group of ``data.engine`` (``TransformersOptions``,
``VLLMOptions``, ``ServerOptions``) before anything loads, documented by the command line, and in step with the
engines' constructors; every shipped config's options pass the check."""

from __future__ import annotations

import inspect
import sys
from dataclasses import MISSING, fields
from pathlib import Path

import pytest
import yaml

from lit_grpo.engines.options import (
    ENGINE_OPTIONS,
    ServerOptions,
    TransformersOptions,
    VLLMOptions,
    engine_options,
)

ROOT = Path(__file__).resolve().parents[1]


def test_a_mapping_becomes_the_group_of_its_engine():
    assert engine_options("transformers", {"compile": False}) == TransformersOptions(compile=False)
    assert engine_options("transformers", None) == TransformersOptions()
    server = engine_options("server", {"url": "http://127.0.0.1:8765", "timeout_s": 120, "bucket_mb": 0.05})
    assert (server.url, server.timeout_s, server.bucket_bytes, server.transfer_backend) == (
        "http://127.0.0.1:8765", 120, int(0.05 * 2**20), "gloo")
    assert engine_options("server", {"kind": "vllm", "url": "http://127.0.0.1:1"}).transfer_backend == "nccl"
    given = ServerOptions(url="http://h:1")
    assert engine_options("server", given) is given


def test_vllm_takes_any_other_key_as_an_llm_argument():
    options = engine_options("vllm", {"dtype": "float32", "max_model_len": 256, "enforce_eager": True,
                                      "llm_kwargs": {"tensor_parallel_size": 1}})
    assert options.dtype == "float32" and options.max_model_len == 256
    assert options.llm_kwargs == {"tensor_parallel_size": 1, "enforce_eager": True}


@pytest.mark.parametrize(("engine", "value", "message"), [
    ("transformers", {"url": "http://h:1"}, r"engine_options \(TransformersOptions\) has no option\(s\) \['url'\]"),
    ("server", {"url": "http://h:1", "bucket": 64}, r"has no option\(s\) \['bucket'\]; expected among \['url'"),
    ("transformers", {"compile": "no"}, r"data.engine_options.compile must be bool, got 'no'"),
    ("transformers", {"decode": "fast"}, r"decode must be one of 'auto', 'static', 'dynamic', got 'fast'"),
    ("server", {"url": "http://h:1", "timeout_s": "soon"}, r"timeout_s must be a number > 0, got 'soon'"),
    ("server", {"url": 8765}, r"data.engine_options.url must be str or null, got 8765"),
    ("server", {"urls": ["http://h:1", 2]}, r"urls must be list or null"),
    ("server", {"url": "http://h:1", "kind": "sglang"}, r"unknown server kind 'sglang'"),
    ("server", {"url": "http://h:1", "backend": "mpi"}, r"unknown backend 'mpi'"),
    ("server", {"url": "http://h:1", "dtype": "float8"}, r"unknown dtype 'float8'"),
    ("vllm", {"gpu_memory_utilization": "half"}, r"gpu_memory_utilization must be float, got 'half'"),
    ("vllm", TransformersOptions(), r"is a TransformersOptions, but data.engine 'vllm' takes a VLLMOptions"),
])
def test_a_bad_option_is_one_line_naming_it(engine, value, message):
    with pytest.raises(ValueError, match=message):
        engine_options(engine, value)


def keyword_defaults(function) -> dict:  # noqa: ANN001
    return {name: p.default for name, p in inspect.signature(function).parameters.items()
            if p.default is not inspect.Parameter.empty}


def group_defaults(cls: type) -> dict:
    return {f.name: f.default if f.default is not MISSING else f.default_factory() for f in fields(cls)}


def test_the_groups_are_the_in_process_engines_keyword_arguments():
    from lit_grpo.engines.transformers_engine import TransformersEngine
    from lit_grpo.engines.vllm_engine import VLLMEngine

    transformers = keyword_defaults(TransformersEngine.__init__)
    # ``weights`` is decided by the fit (engine_setup.shares_weights), which passes copy_weights and shares_policy
    group = {k: v for k, v in group_defaults(TransformersOptions).items() if k != "weights"}
    assert {k: transformers[k] for k in group} == group
    vllm = keyword_defaults(VLLMEngine.__init__)
    expected = {k: v for k, v in group_defaults(VLLMOptions).items() if k != "llm_kwargs"}
    assert {k: vllm[k] for k in expected} == expected


def test_the_server_engine_refuses_what_its_group_does():
    from lit_grpo.engines.remote.client import ServerEngine

    with pytest.raises(ValueError, match=r"ServerEngine \(ServerOptions\) has no option\(s\) \['bucket'\]"):
        ServerEngine(url="http://127.0.0.1:1", token="t" * 32, bucket=1)
    with pytest.raises(ValueError, match="exactly one of url"):
        ServerEngine(token="t" * 32)


def test_every_shipped_config_passes_the_check():
    checked = 0
    for path in sorted((ROOT / "configs").rglob("*.yaml")):
        data = (yaml.safe_load(path.read_text()) or {}).get("data") or {}
        if "engine_options" in data:
            engine_options(data.get("engine", "server" if "url" in data["engine_options"] else "transformers"),
                           data["engine_options"])
            checked += 1
    assert checked >= 2  # the server overlays


@pytest.mark.parametrize("group", sorted(ENGINE_OPTIONS.values(), key=lambda cls: cls.__name__),
                         ids=lambda cls: cls.__name__)
def test_the_command_line_documents_each_group(group, monkeypatch, capsys):
    from lit_grpo.cli.lightning_cli import main

    monkeypatch.setattr(sys, "argv", ["lit_grpo"])
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--data.engine_options.help", group.__name__])
    assert exit_.value.code in (0, None)
    out = capsys.readouterr().out
    for f in fields(group):
        assert f"--data.engine_options.{f.name}" in out, f.name
    assert "--data.engine_options.help" in main_help(monkeypatch, capsys)


def main_help(monkeypatch, capsys) -> str:  # noqa: ANN001
    from lit_grpo.cli.lightning_cli import main

    with pytest.raises(SystemExit):
        main(["fit", "--help-all"])  # every option (`fit --help` is the short list)
    return capsys.readouterr().out
