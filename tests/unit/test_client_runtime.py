"""``devices.runtime``: what the ExecuTorch runtime cannot train is refused, never trained eagerly.

Refused before a run starts (:func:`protocols.check_config`, naming the option) and again by
a device handed such a round (a DeviceFailure its reply carries as a status). The programs a
process keeps across rounds are keyed by what fixes their graph, never by the weights.
"""

from __future__ import annotations

import pytest

from clients.device import DeviceFailure
from clients.executorch_program import architecture
from clients.steps.executorch import ExecuTorchSplitStep, client_step_type, model_settings
from clients.steps.split import SplitStep
from protocols import PROTOCOLS, check_config, compose_config, protocol_named
from splitlearn.config import DevicesConfig, PrivacyConfig, RunSpec
from splitlearn.models import build_model
from tests.conftest import digits_like_model


@pytest.mark.parametrize(("overrides", "message"), [
    (["devices.runtime=tflite"], "devices.runtime='tflite'; accepted: ['eager', 'executorch']"),
    (["strategy=ushaped"], "strategy=ushaped has another device step"),
    (["strategy=local_loss"], "strategy=local_loss has another device step"),
    (["strategy=fedavg"], "strategy=fedavg has another device step"),
    (["privacy=activation_gaussian", "privacy.noise_multiplier=0.5"],
     "with privacy=activation_gaussian"),
    (["privacy=dpsgd_client", "privacy.noise_multiplier=1.0"], "with privacy=dpsgd_client"),
    (["privacy.nopeek_weight=0.1"], "with privacy.nopeek_weight=0.1"),
    (["planner=smartsplit"], "with activation recomputation"),
    (["model=resnet"], "model=resnet at cut 1: devices.runtime=executorch: the device's "
                       "stages hold buffers"),
], ids=["unknown-runtime", "ushaped", "local-loss", "fedavg", "activation-noise",
        "dpsgd", "nopeek", "recomputing-planner", "batchnorm"])
def test_what_the_program_cannot_train_is_refused_before_the_run(overrides, message):
    with pytest.raises(ValueError) as err:
        check_config(compose_config(["devices.runtime=executorch", *overrides]))
    assert message in str(err.value)
    if "accepted" not in message:
        assert "devices.runtime=executorch" in str(err.value)


@pytest.mark.parametrize("overrides", [
    ["strategy=splitfed_v1"], ["strategy=splitfed_v2"], ["strategy=sglr"], ["strategy=sequential"],
    ["model=lenet5"], ["planner=greedy"], ["planner=smartsplit", "planner.recompute=false"],
    ["+privacy.label_epsilon=2.0"], ["compression=int8"],
], ids=["splitfed-v1", "splitfed-v2", "sglr", "sequential", "lenet5", "greedy",
        "smartsplit-without-recomputation", "label-dp", "compression"])
def test_the_split_protocols_are_accepted_with_the_program(overrides):
    check_config(compose_config(["devices.runtime=executorch", *overrides]))


def executorch_spec(**privacy) -> RunSpec:
    return RunSpec(devices=DevicesConfig(runtime="executorch"), privacy=PrivacyConfig(**privacy))


@pytest.mark.parametrize("name", sorted(PROTOCOLS))
def test_a_device_picks_the_step_its_runtime_names(name):
    protocol = protocol_named(name)
    assert client_step_type(protocol, RunSpec(), recompute=False) is protocol.client
    if "executorch" not in protocol.capabilities.runtimes:
        with pytest.raises(DeviceFailure, match=f"strategy={name} has another device step"):
            client_step_type(protocol, executorch_spec(), recompute=False)
        return
    # The program is the split step's device side: a protocol may list the runtime only
    # if its device step is the split step.
    assert issubclass(protocol.client, SplitStep)
    assert client_step_type(protocol, executorch_spec(), recompute=False) is ExecuTorchSplitStep


def test_every_protocol_whose_device_step_is_the_split_step_runs_on_the_program():
    served = sorted(n for n, p in PROTOCOLS.items() if "executorch" in p.capabilities.runtimes)
    split = sorted(n for n, p in PROTOCOLS.items() if p.client is SplitStep)
    assert served == split and "sglr" in served


@pytest.mark.parametrize(("protocol", "spec", "recompute", "message"), [
    ("ushaped", executorch_spec(), False, "strategy=ushaped"),
    ("splitfed_v2", executorch_spec(nopeek_weight=0.5), False, "nopeek_weight=0.5"),
    ("splitfed_v2", executorch_spec(), True, "activation recomputation"),
], ids=["protocol", "nopeek", "recompute"])
def test_a_device_handed_a_round_the_program_cannot_train_refuses_it(protocol, spec, recompute,
                                                                     message):
    with pytest.raises(DeviceFailure, match=message):
        client_step_type(protocol_named(protocol), spec, recompute=recompute)


def test_a_device_refuses_stages_with_buffers():
    model = digits_like_model("resnet")
    with pytest.raises(DeviceFailure, match="hold buffers"):
        ExecuTorchSplitStep(model, executorch_spec(), cut=1)


def test_models_share_a_program_key_only_with_the_same_architecture():
    cnn = architecture(digits_like_model("cnn"), 1)
    assert architecture(digits_like_model("cnn", seed=1), 1) == cnn  # other weights only
    others = [
        architecture(digits_like_model("lenet5"), 1),
        architecture(digits_like_model("cnn"), 2),
        architecture(build_model("cnn", in_channels=1, image_size=16, num_classes=10), 1),
        architecture(build_model("cnn", in_channels=3, image_size=8, num_classes=10), 1),
        architecture(digits_like_model("cnn"), 1, config="another run's settings"),
    ]
    assert len({cnn, *others}) == 1 + len(others)


def test_the_runs_model_and_dataset_settings_are_part_of_the_key():
    spec = RunSpec()
    assert model_settings(RunSpec()) == model_settings(spec)
    spec.model.options = {"width": 2}
    other_data = RunSpec()
    other_data.dataset.image_size = 16
    assert len({model_settings(RunSpec()), model_settings(spec), model_settings(other_data)}) == 3
