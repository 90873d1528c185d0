"""Paged KV is the engine's memory model (issue 34): the default of EngineOptions and of every command
that serves a model, `--kv-layout static` still selectable, and a Transformer-VQ model keeping its
fixed-size memory under the default."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers import init_params, tiny_config, tiny_vq_config

from hkserve.cli.loading import LoadOptions
from hkserve.cli.main import build_parser
from hkserve.engine.engine import Engine
from hkserve.engine.kv_layout import DEFAULT_BLOCK_SIZE, DEFAULT_LAYOUT, check_layout
from hkserve.engine.options import EngineOptions
from hkserve.model.build import build_model
from hkserve.model.paged_memory import PagedKVMemory

CONFIG = tiny_config(context_length=128)


def test_an_engine_built_with_default_options_keeps_its_kv_in_a_pool_of_blocks():
    """The CPU's default pool: what slots x max_len static positions take, in blocks of the default size."""
    params = jax.tree_util.tree_map(np.asarray, init_params(CONFIG, 0))
    engine = Engine(build_model(CONFIG), params, EngineOptions(slots=2, max_len=128))
    assert engine.kv_layout == "paged" and isinstance(engine.state.memory, PagedKVMemory)
    assert engine.kv_pool is not None and engine.kv_pool.total == 2 * 128 // DEFAULT_BLOCK_SIZE
    static = Engine(build_model(CONFIG), params, EngineOptions(slots=2, max_len=128, kv_layout="static"))
    assert static.kv_layout == "static" and static.kv_pool is None


@pytest.mark.parametrize(
    "argv", [["serve"], ["generate", "hi"], ["sample", "--input", "a", "--output", "b"], ["bench", "serve"]]
)
def test_every_command_that_serves_a_model_defaults_to_paged_and_takes_static(argv):
    parser = build_parser()
    assert parser.parse_args(argv).kv_layout == "paged"
    if argv[0] != "bench":  # bench serve passes its layout to the server it starts (test_bench.py)
        assert LoadOptions.from_args(parser.parse_args(argv)).kv_layout == "paged"
    assert parser.parse_args([*argv, "--kv-layout", "static"]).kv_layout == "static"


def test_a_vq_model_keeps_its_fixed_memory_under_the_default_and_kv_cache_mb_needs_a_pool():
    assert DEFAULT_LAYOUT == "paged"
    assert check_layout(tiny_vq_config(), DEFAULT_LAYOUT, DEFAULT_BLOCK_SIZE, None) == "static"
    with pytest.raises(ValueError, match="--kv-cache-mb sizes the paged pool"):
        check_layout(CONFIG, "static", DEFAULT_BLOCK_SIZE, 64.0)
