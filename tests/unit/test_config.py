"""config.py and the CLI built from it, without a model: every field has its flag, the parser's
defaults are the dataclasses' defaults, environment variables only supply CLI defaults."""

from __future__ import annotations

import dataclasses
import os

import pytest

from freetoken import __main__ as cli
from freetoken.config import (
    EngineConfig,
    KernelConfig,
    ServerConfig,
    format_bytes,
    parse_bytes,
)

ENV = ("FREETOKEN_OPS", "FREETOKEN_LINEAR", "FREETOKEN_CPU_ISA", "FREETOKEN_POOL_POLL_US",
       "FREETOKEN_API_KEY")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    # main() sets it when unset; keep that from outliving the test
    monkeypatch.setenv("OMP_WAIT_POLICY", os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))


def fields():
    return [f for cls in cli.CONFIGS for f in dataclasses.fields(cls)]


def test_every_field_has_one_flag_and_every_flag_a_field():
    parser = cli.build_parser()
    flags = {s for a in parser._actions for s in a.option_strings} - {"-h", "--help"}
    by_field = [cli._flag(f) for f in fields()]
    assert len(by_field) == len(set(by_field))
    assert set(by_field) == flags
    for f in fields():
        assert f.metadata["help"], f.name


def test_defaults_are_the_dataclass_defaults():
    server, engine, kernels = cli.configs_from_args(cli.build_parser().parse_args([]))
    assert server == ServerConfig()
    assert engine == EngineConfig()
    assert kernels == KernelConfig()
    assert ServerConfig.max_batch_prompts == ServerConfig().max_batch_prompts == 64
    assert ServerConfig.max_body_bytes == 32 << 20


def test_help_lists_every_flag_with_its_default():
    text = " ".join(cli.build_parser().format_help().split())
    for f in fields():
        assert cli._flag(f) in text, f.name
    for shown in ("(default: 127.0.0.1)", "(default: 8000)", "(default: 64)", "(default: 32MiB)",
                  "(default: 512MiB)", "(default: 2048)", "(default: 1024)", "(default: 25.0)",
                  "(default: 30.0)", "(default: auto)", "(default: info)", "(default: 16)"):
        assert shown in text, shown
    assert "$FREETOKEN_OPS sets the default" in text
    assert "$FREETOKEN_API_KEY" in text


def test_flags_set_their_fields():
    args = cli.build_parser().parse_args([
        "--port", "9", "--request-timeout", "2.5", "--max-body-bytes", "1MiB",
        "--kv-cache-memory", "64MiB", "--num-kv-blocks", "100", "--block-size", "32",
        "--no-prefix-cache", "--partial-block-reuse", "--dtype", "bf16", "--max-queue-len", "7",
        "--api-key", "a,b", "--api-key", "c", "--allowed-origins", "https://x.example",
        "--kernels", "torch", "--linear", "onednn", "--cpu-isa", "avx2", "--pool-poll-us", "0",
    ])
    server, engine, kernels = cli.configs_from_args(args)
    assert (server.port, server.request_timeout_s, server.max_body_bytes) == (9, 2.5, 1 << 20)
    assert server.api_keys == ["a", "b", "c"]
    assert server.allowed_origins == ["https://x.example"]
    assert (engine.kv_cache_memory, engine.num_kv_blocks, engine.block_size) == (64 << 20, 100, 32)
    assert engine.enable_prefix_cache is False and engine.enable_partial_block_reuse is True
    assert engine.dtype == "bf16" and engine.max_queue_len == 7
    assert kernels == KernelConfig(kernels="torch", linear="onednn", cpu_isa="avx2",
                                   pool_poll_us=0)


def test_environment_variables_are_only_cli_defaults(monkeypatch):
    monkeypatch.setenv("FREETOKEN_OPS", "Torch")
    monkeypatch.setenv("FREETOKEN_LINEAR", "panels")
    monkeypatch.setenv("FREETOKEN_CPU_ISA", "base")
    monkeypatch.setenv("FREETOKEN_POOL_POLL_US", "50")
    parser = cli.build_parser()
    _, _, kernels = cli.configs_from_args(parser.parse_args([]))
    assert kernels == KernelConfig(kernels="torch", linear="panels", cpu_isa="base",
                                   pool_poll_us=50)
    assert KernelConfig() == KernelConfig(kernels="auto", linear="auto", cpu_isa="auto",
                                          pool_poll_us=None)  # the dataclass never reads them
    _, _, kernels = cli.configs_from_args(parser.parse_args(["--kernels", "ext",
                                                             "--pool-poll-us", "7"]))
    assert (kernels.kernels, kernels.pool_poll_us) == ("ext", 7)  # a flag wins
    assert "(default: panels)" in " ".join(parser.format_help().split())


def test_api_key_env_is_read_when_no_flag_and_never_shown(monkeypatch):
    monkeypatch.setenv("FREETOKEN_API_KEY", "secret-1,secret-2")
    parser = cli.build_parser()
    assert "secret" not in parser.format_help()
    server, _, _ = cli.configs_from_args(parser.parse_args([]))
    assert server.api_keys == ["secret-1", "secret-2"]
    server, _, _ = cli.configs_from_args(parser.parse_args(["--api-key", "k"]))
    assert server.api_keys == ["k"]


@pytest.mark.parametrize("argv", [
    ["--max-batch-prompts", "0"],
    ["--max-num-seqs", "0"],
    ["--device", "tpu"],
    ["--arrival-gap-ms", "-1"],
    ["--port", "70000"],
])
def test_bad_values_exit_2_before_anything_loads(argv, capsys):
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.startswith("freetoken: ")


def test_kernel_choices_reach_ops_configure_before_the_model_loads(monkeypatch, capsys):
    from freetoken import ops

    calls = []

    def configure(**kw):
        calls.append(kw)
        raise ValueError("refused here")

    monkeypatch.setattr(ops, "configure", configure)
    argv = ["--kernels", "torch", "--linear", "panels", "--cpu-isa", "avx2", "--pool-poll-us", "5",
            "--compute", "int8"]
    assert cli.main(argv) == 2
    assert calls == [dict(backend="torch", linear="panels", cpu_isa="avx2", pool_poll_us=5,
                          compute="int8")]
    assert "refused here" in capsys.readouterr().err


@pytest.mark.parametrize("text,value", [("512MiB", 512 << 20), ("32MiB", 32 << 20), ("2G", 2 << 30),
                                        ("1000", 1000), ("3KiB", 3 << 10)])
def test_bytes_round_trip(text, value):
    assert parse_bytes(text) == value
    assert parse_bytes(format_bytes(value)) == value
