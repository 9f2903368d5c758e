"""clients.connect: the SuperNode command a device runs, and what its node config means."""

from __future__ import annotations

import datasets
import pytest
import torch
from flwr.common.config import parse_config_args

from clients.app import CACHE_KEY, DATA_KEY, TRUNK_ROOTS_KEY
from clients.connect import format_node_config, node_config, parse_args, supernode_command
from clients.device import PROFILE_KEY, declared_profile, measured_time, plan_round
from splitlearn.config import DatasetConfig, RunSpec
from splitlearn.data import load_digits_splits, local_dataset
from splitlearn.planning.clock import ClientMeasurement


def args(*extra: str):
    return parse_args(["--superlink", "10.0.0.2:9091", "--profile", "mid_range_phone", *extra])


def test_the_node_config_flower_parses_is_the_one_built(tmp_path):
    data = tmp_path / "my data.parquet"  # a space survives the quoting
    data.write_bytes(b"")
    roots = tmp_path / "ca.crt"
    roots.write_text("pem")
    parsed = args("--data", str(data), "--root-certificates", str(roots), "--partition-id", "2",
                  "--num-partitions", "5", "--min-noise-multiplier", "1.5",
                  "--privacy-option", "activation_gaussian", "--epsilon-max", "4",
                  "--secure-aggregation")
    built = node_config(parsed)
    # Flower's own parser reads back exactly what was meant.
    assert parse_config_args([format_node_config(built)]) == built
    assert built[DATA_KEY] == str(data) and built[TRUNK_ROOTS_KEY] == str(roots)
    assert built[PROFILE_KEY] == "mid_range_phone" and built["partition-id"] == 2
    assert built["privacy-min-noise-multiplier"] == 1.5 and built["privacy-epsilon-max"] == 4.0
    assert built["privacy-secure-aggregation"] is True
    assert "privacy-secure-aggregation" not in node_config(args())  # only when asked
    command = supernode_command(parsed)
    assert command[command.index("--root-certificates") + 1] == str(roots)
    assert "--insecure" not in command


@pytest.mark.parametrize(("extra", "message"), [
    (["--partition-id", "3", "--num-partitions", "3"], "--partition-id 3 must be in 0..2"),
    (["--data", "/nonexistent/data.parquet"], "--data /nonexistent/data.parquet: no such"),
    (["--min-noise-multiplier", "-1"], "privacy-min-noise-multiplier must be"),
])
def test_bad_arguments_fail_naming_them(extra, message):
    with pytest.raises(ValueError, match=message):
        supernode_command(args(*extra))


def test_unknown_profile_and_tls_with_insecure_are_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--superlink", "h:1", "--profile", "toaster"])
    assert "invalid choice: 'toaster'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        args("--insecure", "--root-certificates", "ca.crt")


def test_a_declared_device_keeps_its_budget_and_nothing_is_emulated():
    spec = RunSpec()
    spec.failures.dropout_rate = 1.0  # an emulated device would vanish every round
    declared = declared_profile("low_end_phone")
    plan = plan_round(spec, server_round=1, partition_id=0, num_partitions=1, declared=declared)
    assert plan.available and plan.fail_after_steps == -1 and not plan.emulated
    assert plan.profile.memory_bytes == declared.memory_bytes
    with pytest.raises(ValueError, match="'toaster' is not a device preset; known: .*wearable"):
        declared_profile("toaster")
    # Its time is its own: compute as measured, the rest of the round waiting on links.
    time = measured_time(ClientMeasurement(1.5, 10, 10, 3), wall_s=4.0)
    assert time.compute_s == 1.5 and time.total_s == 4.0


def test_a_devices_own_parquet_data_loads_as_the_runs_dataset(tmp_path):
    train, _ = load_digits_splits()
    share = train.select(range(40))
    share.to_parquet(tmp_path / "a.parquet")
    data = local_dataset(tmp_path / "a.parquet", DatasetConfig(image_size=16))
    images, labels = data.tensors
    assert images.shape == (40, 1, 16, 16)
    assert torch.equal(labels, torch.tensor(share["label"]))
    assert len(local_dataset(tmp_path, DatasetConfig())) == 40  # a folder of parquet files


@pytest.mark.parametrize(("rows", "message"), [
    ({"pixels": [[[0.0] * 8] * 8], "label": [1]}, r"needs \['image'\] as well"),
    ({"image": [[[0.0] * 8] * 8], "label": [10]}, "span 10..10; digits has classes 0..9"),
])
def test_bad_device_data_fails_with_the_reason(tmp_path, rows, message):
    datasets.Dataset.from_dict(rows).to_parquet(tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=message):
        local_dataset(tmp_path / "bad.parquet", DatasetConfig())
    with pytest.raises(ValueError, match="no parquet file"):
        local_dataset(tmp_path / "empty", DatasetConfig())


def test_a_device_keeps_its_data_in_its_cache_folder_unless_told_not_to(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    built = node_config(args())
    assert built[CACHE_KEY] == str(tmp_path / "splitlearn")
    assert parse_config_args([format_node_config(built)]) == built
    assert node_config(args("--cache-dir", str(tmp_path / "mine")))[CACHE_KEY] == str(
        tmp_path / "mine")
    assert CACHE_KEY not in node_config(args("--no-cache"))


def test_a_taken_port_is_named_and_without_one_a_free_one_is_taken(monkeypatch):
    import socket

    from clients import connect

    with socket.create_server(("127.0.0.1", 0)) as held:  # another SuperNode's runtime API
        taken = held.getsockname()[1]
        with pytest.raises(ValueError, match=f"--port {taken}: 127.0.0.1:{taken} is in use"):
            connect.runtime_port(taken)
        monkeypatch.setattr(connect, "FLOWER_RUNTIME_PORT", taken)  # Flower's default is taken
        port, note = connect.runtime_port(None)
        assert port != taken and connect.port_is_free(port)
        assert f"port {taken} is in use" in note and "--port" in note
    assert connect.runtime_port(None) == (taken, None)  # free again: Flower's own
    command = supernode_command(args(), port=port)
    assert command[command.index("--port") + 1] == str(port)
    with pytest.raises(SystemExit):
        args("--port", "70000")


def test_a_devices_reply_names_the_preset_it_declared_and_its_row_shows_it(task_identity):
    from flwr.app import Context, Message, MetricRecord, RecordDict

    from clients.app import with_declared_profile
    from strategies import reporting

    def row(node_config: dict) -> dict:
        context = Context(run_id=1, node_id=7, node_config=node_config, state=RecordDict(),
                          run_config={})
        content = with_declared_profile(
            RecordDict({"metrics": MetricRecord({"partition-id": 0})}), context)
        sent = Message(content=RecordDict(), dst_node_id=7, message_type="train.splitfed_v2")
        return reporting.client_row(Message(content, reply_to=sent), "ok")

    assert row({PROFILE_KEY: "raspberry_pi_4"})["profile"] == "raspberry_pi_4"
    assert "profile" not in row({})  # the server's fleet (or "host") says
    assert row({PROFILE_KEY: "x" * 500})["profile"] == "x" * reporting.PROFILE_NAME_CHARS
