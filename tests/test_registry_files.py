"""A registered version whose files are gone (an artifact store cleaned up by hand, a lost volume): the error
names the version and the missing file and says how to move the alias, where it said "train one first" (and a
missing policy.pt was a traceback). And a plan records the version an alias named (registry.pinned)."""
from __future__ import annotations

import re
import sqlite3

import pytest
import yaml

from embshard import registry
from embshard.errors import ModelFilesMissingError


@pytest.fixture()
def store(tmp_path, monkeypatch):
    """A local sqlite store with the two tables the loader reads: version 3 of 'm', aliased champion."""
    db = tmp_path / "mlflow.db"
    folder = tmp_path / "mlartifacts" / "m-1" / "artifacts"
    with sqlite3.connect(db) as con:
        con.execute("CREATE TABLE model_versions (name TEXT, version INTEGER, storage_location TEXT, status TEXT)")
        con.execute("CREATE TABLE registered_model_aliases (name TEXT, alias TEXT, version INTEGER)")
        con.execute("INSERT INTO model_versions VALUES ('m', 3, ?, 'READY')", (f"file://{folder}",))
        con.execute("INSERT INTO registered_model_aliases VALUES ('m', 'champion', 3)")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{db}")
    monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)
    # The store this process uses (once mlflow is imported, earlier tests' in-process URI would win)
    monkeypatch.setattr(registry, "_store_uri", lambda: f"sqlite:///{db}")
    return folder


def test_missing_files_of_a_registered_version_are_named(store):
    with pytest.raises(ModelFilesMissingError, match="version 3 of 'm' is registered but its files are missing "
                                                     r"\(no folder .*m-1/artifacts\)") as err:
        registry.local_artifacts("models:/m@champion")
    assert "set_registered_model_alias" in err.value.fix
    (store / "artifacts").mkdir(parents=True)
    (store / "artifacts" / "policy.json").write_text("{}")
    (store / "MLmodel").write_text(yaml.safe_dump({"flavors": {"python_function": {"artifacts": {
        "policy_config": {"path": "artifacts/policy.json"}, "policy_weights": {"path": "artifacts/policy.pt"}}}}}))
    with pytest.raises(ModelFilesMissingError, match=r"no .*artifacts/policy\.pt\)"):
        registry.local_artifacts("models:/m/3")
    (store / "artifacts" / "policy.pt").write_bytes(b"x")
    assert set(registry.local_artifacts("models:/m@champion")) == {"policy_config", "policy_weights"}


def test_an_alias_is_pinned_to_its_version(store):
    assert registry.pinned("models:/m@champion") == "models:/m/3"
    assert registry.pinned("models:/m@nosuch") == "models:/m@nosuch"  # loading it words the error
    assert registry.pinned("models:/m/2") == "models:/m/2" and registry.pinned("runs:/abc/model") == "runs:/abc/model"


def test_the_registered_planner_refuses_a_call_without_devices_or_memory():
    """MLflow fills a predict call's missing params with the signature's defaults: 0 devices, which the pyfunc
    refuses (it planned for the validation task's devices and memory, a plan for the wrong cluster)."""
    import pandas as pd

    from embshard.errors import EmbshardError
    from embshard.planners.registered import PolicyPythonModel

    model = PolicyPythonModel()
    for params, said in ((None, "num_devices is 0 (0: not given, or given as 0); memory_bytes_per_device is 0"),
                         ({"num_devices": 0, "memory_bytes_per_device": 0}, "num_devices is 0 (0: not given"),
                         ({"num_devices": 4}, "memory_bytes_per_device is 0 (0: not given"),
                         ({"num_devices": -2, "memory_bytes_per_device": 2**30}, "num_devices is -2$"),
                         ({"num_devices": 4, "memory_bytes_per_device": -1}, "memory_bytes_per_device is -1$")):
        with pytest.raises(EmbshardError) as err:
            model.predict(None, pd.DataFrame(), params=params)
        assert re.search(said.replace("(", "\\(").replace(")", "\\)"), err.value.message), err.value.message
        assert "num_devices" in err.value.fix
    # 0.5 meant as GiB had been cut to 0 bytes ("no memory given"): a fraction is refused, naming the unit
    with pytest.raises(EmbshardError, match="memory_bytes_per_device is a whole number \\(bytes\\), got 0.5") as err:
        model.predict(None, pd.DataFrame(), params={"num_devices": 4, "memory_bytes_per_device": 0.5})
    assert "2**30" in err.value.fix


def test_the_registered_planner_plans_for_hosts_and_refuses_memory_place_refuses(small_tables_df):
    """`devices_per_host` plans for hosts (TorchRec's export needs them above 128 GPUs; the pyfunc had dropped it),
    and memory above 1 PiB per device is refused as `embshard place --memory-gb` refuses it."""
    from fixed_models import analytic

    from embshard.errors import EmbshardError
    from embshard.planners.registered import PolicyPythonModel

    model = PolicyPythonModel()
    model.policy, model.cost_model = None, analytic()
    params = {"num_devices": 4, "memory_bytes_per_device": 2**40}
    out = model.predict(None, small_tables_df, params={**params, "devices_per_host": 2})
    assert set(out["devices_per_host"]) == {2} and set(out["device"]) <= {0, 1, 2, 3}
    one = model.predict(None, small_tables_df, params={**params, "devices_per_host": 0})
    assert "devices_per_host" not in one or one["devices_per_host"].isna().all()
    with pytest.raises(EmbshardError, match="do not split into hosts of 3"):
        model.predict(None, small_tables_df, params={**params, "devices_per_host": 3})
    with pytest.raises(EmbshardError, match="more than 1,048,576 GiB") as err:
        model.predict(None, small_tables_df, params={**params, "memory_bytes_per_device": 2**51})
    assert err.value.field == "memory_bytes_per_device"
