"""docs/config.md is generated from the knob list and must stay in sync."""
import os

from tests.harness import ROOT


def test_docs_config_is_up_to_date():
    from horovod_torch.config import markdown
    with open(os.path.join(ROOT, "docs", "config.md")) as f:
        assert f.read() == markdown(), \
            "docs/config.md is stale: run python -m horovod_torch.config --markdown > docs/config.md"


def test_bad_knob_value_is_a_clear_error(monkeypatch):
    import horovod_torch as hvd
    import pytest
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "lots")
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "soon")
    with pytest.raises(ValueError) as e:
        hvd.init()
    msg = str(e.value)
    assert "HOROVOD_FUSION_THRESHOLD='lots' is not an integer (see docs/config.md)" in msg, msg
    assert "HOROVOD_CYCLE_TIME='soon' is not a number" in msg, msg
    assert not msg.endswith("; "), msg
    assert not hvd.is_initialized()
