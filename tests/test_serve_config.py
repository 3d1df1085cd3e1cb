"""rollout/conf/serve.yaml composes into ServeConfig; bad server settings are refused before anything loads."""

from __future__ import annotations

import pytest

from rollout.cli import serve
from rollout.serve.config import ServeConfig
from tests.script_helpers import compose, message_regex


def _config(*overrides: str) -> ServeConfig:
    return serve.load_config(compose("serve", *overrides))


def test_defaults_are_the_tiny_model_on_loopback():
    c = _config()
    assert (c.server.host, c.server.port, c.model.path) == ("127.0.0.1", 8000, None)
    assert (c.sampling.n, c.sampling.max_tokens) == (1, 16)  # OpenAI's defaults for omitted fields
    assert c.engine.max_num_seqs == 64  # the main job's engine group
    assert (c.server.api_key, c.server.admin, c.server.allow_request_chat_template) == (None, True, False)
    assert c.server.weight_sources == ("loopback", "client") and c.server.weights_root is None


@pytest.mark.parametrize(
    "override, needle",
    [
        ("server.port=70000", "server.port=70000"),
        ("server.host=''", "server.host"),
        ("server.max_n=0", "server.max_n=0"),
        ("server.log_level=loud", "server.log_level='loud'"),
        ("server.max_connections=0", "server.max_connections=0"),
        ("server.header_timeout_s=0", "server.header_timeout_s=0"),
        ("server.stream_buffer_tokens=-1", "server.stream_buffer_tokens=-1"),
        ("server.stream_interval_s=-0.5", "server.stream_interval_s=-0.5"),
        ("+server.bogus=1", "server.bogus"),
        ("server.admin=maybe", "server.admin='maybe'"),
        ("server.weight_sources=[loopback,not-an-ip]", "server.weight_sources entry 'not-an-ip'"),
        ("server.max_weight_timeout_s=0", "server.max_weight_timeout_s=0"),
        ("server.api_key=''", "server.api_key"),
        ("engine.block_size=12", "block_size"),
        ("sampling.temperature=-1", "sampling.temperature"),
    ],
)
def test_bad_settings_are_named(override, needle):
    with pytest.raises(ValueError, match=message_regex(needle)):
        _config(override)
