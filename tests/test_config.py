"""The structured config: composition, typos and types rejected, presets in one place."""
import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from conf.schema import register
from tests.conftest import compose_config

register()


_compose = compose_config


def test_default_composition():
    cfg = _compose()
    assert cfg.model.name == "tiny" and cfg.cluster.name == "local_cpu" and cfg.mode == "run"
    assert cfg.framework.name == "deepspeed" and cfg.ledger.mode == "faithful"


@pytest.mark.parametrize("fw,knob", [("megatron", "use_distributed_optimizer"), ("deepspeed", "zero_stage"),
                                     ("titan", "reshard_after_forward")])
def test_framework_groups_have_their_knobs(fw, knob):
    assert knob in _compose(f"framework={fw}").framework


def test_typo_is_an_error():
    with pytest.raises(ConfigCompositionException):
        _compose("layout.tpp=2")


def test_wrong_type_is_an_error():
    with pytest.raises((ConfigCompositionException, ValidationError)):
        _compose("layout.tp=two")


def test_knob_of_another_framework_is_an_error():
    with pytest.raises(ConfigCompositionException):
        _compose("framework=titan", "framework.zero_stage=3")


def test_model_presets_come_from_the_ledger():
    from ledger.model import preset

    cfg = _compose("model=llama3_1b", "model.seq_len=4096")
    assert cfg.model.seq_len == 4096
    assert cfg.model.hidden == preset("llama3_1b").hidden
