"""Settings: defaults, ATRIUM_* variables, flags over variables, and rejected values."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from web.cli import build_parser
from web.settings import Settings, SettingsError


def test_defaults_match_the_contract() -> None:
    settings = Settings.load(environ={})
    assert (settings.host, settings.port, settings.model) == ("127.0.0.1", 8000, "default")
    assert settings.database_url == "sqlite+aiosqlite:///./atrium.db"
    assert settings.admin_token is None


def test_environment_is_parsed_into_typed_fields() -> None:
    env = {
        "ATRIUM_PORT": "9001",
        "ATRIUM_DATABASE_URL": "postgresql+asyncpg://db/atrium",
        "ATRIUM_DRAIN_GRACE_S": "2.5",
        "ATRIUM_MAX_NUM_BATCHED_TOKENS": "256",
        "ATRIUM_ADMIN_TOKEN": "t0ken",
        "UNRELATED": "x",
    }
    settings = Settings.load(environ=env)
    assert settings.port == 9001
    assert settings.database_url.startswith("postgresql")
    assert settings.drain_grace_s == 2.5
    assert settings.max_num_batched_tokens == 256
    assert settings.admin_token == "t0ken"


def test_flags_override_environment_and_none_means_unset() -> None:
    settings = Settings.load({"port": 7000, "host": None}, environ={"ATRIUM_PORT": "9001"})
    assert settings.port == 7000
    assert settings.host == "127.0.0.1"


@pytest.mark.parametrize(
    "env",
    [
        {"ATRIUM_PORT": "eighty"},
        {"ATRIUM_PORT": "70000"},
        {"ATRIUM_DTYPE": "int4"},
        {"ATRIUM_DEVICE": "tpu"},
        {"ATRIUM_MAX_BODY_BYTES": "0"},
    ],
)
def test_bad_values_are_rejected(env: dict[str, str]) -> None:
    with pytest.raises(SettingsError):
        Settings.load(environ=env)


def test_torch_threads_come_from_the_environment_and_must_be_positive() -> None:
    assert Settings.load(environ={"ATRIUM_TORCH_THREADS": "1"}).torch_threads == 1
    assert Settings.load(environ={}).torch_threads is None
    with pytest.raises(SettingsError):
        Settings.load(environ={"ATRIUM_TORCH_THREADS": "0"})


def test_speculative_tokens_default_to_four_and_take_zero_to_turn_drafts_off() -> None:
    assert Settings.load(environ={}).speculative_tokens == 4
    assert Settings.load(environ={"ATRIUM_SPECULATIVE_TOKENS": "0"}).speculative_tokens == 0
    assert Settings.load({"speculative_tokens": 8}, environ={}).speculative_tokens == 8
    for bad in ("-1", "65", "many"):
        with pytest.raises(SettingsError):
            Settings.load(environ={"ATRIUM_SPECULATIVE_TOKENS": bad})


def test_the_draft_batch_limit_comes_from_the_environment_and_must_be_positive() -> None:
    assert Settings.load(environ={}).speculative_max_batch is None
    assert Settings.load(environ={"ATRIUM_SPECULATIVE_MAX_BATCH": "8"}).speculative_max_batch == 8
    assert Settings.load({"speculative_max_batch": 64}, environ={}).speculative_max_batch == 64
    for bad in ("0", "-3", "few"):
        with pytest.raises(SettingsError):
            Settings.load(environ={"ATRIUM_SPECULATIVE_MAX_BATCH": bad})


def test_dtype_auto_is_resolved_for_the_cpu_and_explicit_dtypes_are_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    settings = Settings.load({"device": "cpu"}, environ={})
    assert settings.dtype == "auto"
    for native, expected in [(True, "bfloat16"), (False, "float32")]:
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=native: v)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
        assert settings.resolved_dtype == expected
        explicit = Settings.load({"device": "cpu"}, environ={"ATRIUM_DTYPE": "bfloat16"})
        assert explicit.resolved_dtype == "bfloat16"


def test_target_tpot_is_auto_by_default_and_takes_off_or_milliseconds() -> None:
    assert Settings.load(environ={}).engine_target_tpot_ms == "auto"
    assert Settings.load(environ={"ATRIUM_TARGET_TPOT_MS": "off"}).engine_target_tpot_ms is None
    assert Settings.load(environ={"ATRIUM_TARGET_TPOT_MS": "80"}).engine_target_tpot_ms == 80.0
    assert Settings.load({"target_tpot_ms": "12.5"}, environ={}).engine_target_tpot_ms == 12.5
    for bad in ("0", "-5", "fast", "inf", "nan"):
        with pytest.raises(SettingsError, match="target_tpot_ms"):
            Settings.load(environ={"ATRIUM_TARGET_TPOT_MS": bad})


def test_target_ttft_is_off_by_default_and_takes_milliseconds() -> None:
    assert Settings.load(environ={}).engine_target_ttft_ms == 2000.0
    assert Settings.load(environ={"ATRIUM_TARGET_TTFT_MS": "off"}).engine_target_ttft_ms is None
    assert Settings.load(environ={"ATRIUM_TARGET_TTFT_MS": "500"}).engine_target_ttft_ms == 500.0
    args = build_parser().parse_args(["serve", "--target-ttft-ms", "750"])
    assert args.target_ttft_ms == "750"
    assert Settings.load({"target_ttft_ms": "750"}, environ={}).engine_target_ttft_ms == 750.0
    for bad in ("0", "-5", "auto", "inf", "nan"):
        with pytest.raises(SettingsError, match="target_ttft_ms"):
            Settings.load(environ={"ATRIUM_TARGET_TTFT_MS": bad})


def test_kv_pool_is_sized_from_free_memory_unless_bytes_are_set() -> None:
    defaults = Settings.load(environ={})
    assert (defaults.kv_cache_bytes, defaults.kv_cache_memory_fraction) == (None, None)
    env = {"ATRIUM_KV_CACHE_BYTES": str(4 * 2**30), "ATRIUM_KV_CACHE_MEMORY_FRACTION": "0.4"}
    settings = Settings.load(environ=env)
    assert (settings.kv_cache_bytes, settings.kv_cache_memory_fraction) == (4 * 2**30, 0.4)
    assert (
        Settings.load({"kv_cache_memory_fraction": 0.1}, environ=env).kv_cache_memory_fraction
        == 0.1
    )
    args = build_parser().parse_args(["serve", "--kv-cache-memory-fraction", "0.5"])
    assert args.kv_cache_memory_fraction == 0.5 and args.kv_cache_bytes is None
    for bad in ({"ATRIUM_KV_CACHE_BYTES": "0"}, {"ATRIUM_KV_CACHE_MEMORY_FRACTION": "0"}):
        with pytest.raises(SettingsError, match="kv_cache"):
            Settings.load(environ=bad)
    with pytest.raises(SettingsError, match=r"kv_cache_memory_fraction must be in \(0, 0.95\]"):
        Settings.load(environ={"ATRIUM_KV_CACHE_MEMORY_FRACTION": "1.0"})


def test_served_model_name_flag_and_twin() -> None:
    args = build_parser().parse_args(["serve", "--served-model-name", "org/chat-model"])
    flags = {name: getattr(args, name, None) for name in Settings.__struct_fields__}
    assert Settings.load(flags, environ={}).served_model_name == "org/chat-model"
    env = {"ATRIUM_SERVED_MODEL_NAME": "twin"}
    assert Settings.load(environ=env).served_model_name == "twin"
    assert Settings.load(environ={}).served_model_name is None
    with pytest.raises(SettingsError, match="served_model_name"):
        Settings.load({"served_model_name": "bad\nname"}, environ={})


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"ATRIUM_ROLE": "router"}, "role must be"),
        ({"ATRIUM_ROLE": "engine"}, "needs ATRIUM_ENGINE_TOKEN"),
        ({"ATRIUM_ROLE": "gateway", "ATRIUM_ENGINE_TOKEN": "t"}, "needs --engine-url"),
        ({"ATRIUM_ROLE": "gateway", "ATRIUM_ENGINE_URL": "http://r:1"}, "ATRIUM_ENGINE_TOKEN"),
        ({"ATRIUM_ENGINE_URL": "r:30000"}, "engine_url must be"),
        ({"ATRIUM_GATEWAY_URL": "ftp://g"}, "gateway_url must be"),
        ({"ATRIUM_ENGINE_READ_TIMEOUT_S": "0"}, "engine_read_timeout_s"),
    ],
)
def test_roles_need_their_token_and_urls(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        Settings.load(environ=env)


def test_role_and_engine_url_come_from_flags() -> None:
    args = build_parser().parse_args(
        ["serve", "--role", "gateway", "--engine-url", "http://router:30000"]
    )
    flags = {name: getattr(args, name, None) for name in Settings.__struct_fields__}
    settings = Settings.load(flags, environ={"ATRIUM_ENGINE_TOKEN": "t"})
    assert (settings.role, settings.engine_url) == ("gateway", "http://router:30000")
    assert Settings.load(environ={}).role == "all"


def test_server_limits_come_from_the_environment_and_are_checked() -> None:
    default = Settings.load(environ={})
    assert (default.header_timeout_s, default.keep_alive_timeout_s) == (10.0, 5)
    assert default.max_connections == 1024
    env = {
        "ATRIUM_HEADER_TIMEOUT_S": "2.5",
        "ATRIUM_KEEP_ALIVE_TIMEOUT_S": "30",
        "ATRIUM_MAX_CONNECTIONS": "0",  # no limit
    }
    loaded = Settings.load(environ=env)
    assert (loaded.header_timeout_s, loaded.keep_alive_timeout_s) == (2.5, 30)
    assert loaded.max_connections == 0
    for bad in (
        {"ATRIUM_HEADER_TIMEOUT_S": "0"},
        {"ATRIUM_HEADER_TIMEOUT_S": "inf"},
        {"ATRIUM_KEEP_ALIVE_TIMEOUT_S": "0"},
        {"ATRIUM_MAX_CONNECTIONS": "-1"},
    ):
        with pytest.raises(SettingsError):
            Settings.load(environ=bad)


def test_lora_slots_and_rank_come_from_flags_and_twins_and_are_checked() -> None:
    defaults = Settings.load(environ={})
    assert (defaults.max_loras, defaults.max_lora_rank) == (4, 16)
    args = build_parser().parse_args(["serve", "--max-loras", "0", "--max-lora-rank", "64"])
    flags = {name: getattr(args, name, None) for name in Settings.__struct_fields__}
    loaded = Settings.load(flags, environ={"ATRIUM_MAX_LORAS": "8"})
    assert (loaded.max_loras, loaded.max_lora_rank) == (0, 64)
    assert Settings.load(environ={"ATRIUM_MAX_LORAS": "8"}).max_loras == 8
    for bad in ({"max_loras": -1}, {"max_loras": 257}, {"max_lora_rank": 0}):
        with pytest.raises(SettingsError, match="max_lora"):
            Settings.load(bad, environ={})


def test_prefill_kernel_comes_from_its_twin_and_is_checked_by_the_engine_config_too() -> None:
    assert Settings.load(environ={}).prefill_kernel == "auto"
    assert Settings.load(environ={"ATRIUM_PREFILL_KERNEL": "fa2"}).prefill_kernel == "fa2"
    with pytest.raises(SettingsError, match="prefill_kernel must be one of auto, fa2, fa3"):
        Settings.load(environ={"ATRIUM_PREFILL_KERNEL": "fa4"})
    with pytest.raises(ValueError, match="prefill_kernel"):
        EngineConfig(prefill_kernel="fa4")


def test_cuda_graphs_are_on_by_default_and_reach_the_engine_config() -> None:
    default = Settings.load(environ={})
    assert default.engine_cuda_graphs is True and default.engine_cuda_graph_sizes is None
    off = Settings.load(environ={"ATRIUM_CUDA_GRAPHS": "off", "ATRIUM_CUDA_GRAPH_SIZES": "8,1,2"})
    assert off.engine_cuda_graphs is False and off.engine_cuda_graph_sizes == (1, 2, 8)
    args = build_parser().parse_args(["serve", "--cuda-graphs", "off", "--cuda-graph-sizes", "4"])
    assert (args.cuda_graphs, args.cuda_graph_sizes) == ("off", "4")
    flags = Settings.load({"cuda_graphs": args.cuda_graphs}, environ={})
    assert flags.engine_cuda_graphs is False
    for bad in ({"ATRIUM_CUDA_GRAPHS": "maybe"}, {"ATRIUM_CUDA_GRAPH_SIZES": "1,x"}):
        with pytest.raises(SettingsError, match="cuda_graph"):
            Settings.load(environ=bad)
    with pytest.raises(SettingsError, match="1 to max_num_seqs"):
        Settings.load(environ={"ATRIUM_CUDA_GRAPH_SIZES": "128", "ATRIUM_MAX_NUM_SEQS": "64"})
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--cuda-graphs", "yes"])


def test_overlapped_steps_are_on_by_default_and_reach_the_engine_config() -> None:
    assert Settings.load(environ={}).engine_overlap_steps is True
    assert Settings.load(environ={"ATRIUM_OVERLAP_STEPS": "off"}).engine_overlap_steps is False
    args = build_parser().parse_args(["serve", "--overlap-steps", "off"])
    assert (
        Settings.load({"overlap_steps": args.overlap_steps}, environ={}).engine_overlap_steps
        is False
    )
    with pytest.raises(SettingsError, match="overlap_steps"):
        Settings.load(environ={"ATRIUM_OVERLAP_STEPS": "maybe"})
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--overlap-steps", "yes"])
