"""Benchmarks declare what they support; the rest of fedvl reads it instead of their names."""

from __future__ import annotations

from dataclasses import fields

import pytest

from fedvl.config import RunConfig, written_fields
from fedvl.data.sources import DataError, DataOptions, require_data_dir
from fedvl.data.spec import DEFAULT_SPEC, BenchmarkSpec, benchmarks_where, listed, spec_of
from fedvl.options import option_fields
from fedvl.registry import BENCHMARKS
from fedvl.run.assemble import data_options


def test_every_builtin_benchmark_declares_a_spec():
    for name in BENCHMARKS.names():
        assert isinstance(getattr(BENCHMARKS.get(name), "spec", None), BenchmarkSpec), name
    assert benchmarks_where(lambda s: not s.needs_data_dir) == ["digits-offline", "fashion-mnist"]
    assert benchmarks_where(lambda s: s.client_names is not None) == ["digits-offline"]
    assert spec_of("cifar10c").partitions == 3 and spec_of("digits").partitions is None
    with pytest.raises(KeyError, match="unknown benchmark 'nope'; allowed: .*digits-offline"):
        spec_of("nope")


def test_a_benchmark_registered_without_a_spec_gets_the_defaults(monkeypatch):
    def plain(opts: DataOptions) -> None:
        """A factory registered the plain way."""

    monkeypatch.setitem(BENCHMARKS._table, "plain-benchmark", plain)
    assert spec_of("plain-benchmark") is DEFAULT_SPEC
    assert DEFAULT_SPEC.num_clients(DataOptions()) is None
    # Nothing declared about what it reads: config.yaml keeps every field.
    assert written_fields(RunConfig(benchmark="plain-benchmark")) == RunConfig(
        benchmark="plain-benchmark").to_dict()


def test_config_yaml_records_the_options_the_benchmark_declares_it_reads(monkeypatch):
    def mine(opts: DataOptions) -> None:
        """A factory that reads `--dataset` and splits labels."""

    mine.spec = BenchmarkSpec(reads=frozenset({"dataset"}), label_split="always")
    monkeypatch.setitem(BENCHMARKS._table, "mine", mine)
    written = written_fields(RunConfig(benchmark="mine"))
    assert {"dataset", "alpha", "partition", "data_dir"} <= set(written)
    assert not {"domains", "severity", "num_clients", "partitions"} & set(written)
    # A field set away from its default is always written, read or not.
    assert written_fields(RunConfig(benchmark="mine", severity=5))["severity"] == 5
    # A run reading nothing of MedMNIST but using it as its public set records the options the
    # public set is built with.
    offline = written_fields(RunConfig(benchmark="digits-offline", public="medmnist"))
    assert {"dataset", "num_clients"} <= set(offline) and "severity" not in offline


def test_data_options_come_from_the_run_config():
    # Every data option but the node-only `only_client` is a run-config field of the same name.
    names = {f.name for f in fields(DataOptions)}
    assert names - {f.name for f in option_fields(RunConfig)} == {"only_client"}
    cfg = RunConfig(seed=4, domains=["handwritten"], train_cap=30, partitions=2, alpha=0.3,
                    partition="shards", shards_per_client=3, severity=5, num_clients=6)
    opts = data_options(cfg, only_client=1)
    assert all(getattr(opts, n) == getattr(cfg, n) for n in names - {"only_client"})
    assert opts.only_client == 1


def test_messages_list_the_registered_benchmarks():
    with pytest.raises(DataError, match="or use a benchmark that needs none: 'digits-offline'"):
        require_data_dir(DataOptions(), "digits")
    with pytest.raises(DataError, match=r"--partitions applies to cifar10c, digits-offline, "
                                        r"imagefolder, npz-domains and office-caltech10$"):
        DataOptions(partitions=2).refuse_partitions("x", "has one client")
    with pytest.raises(DataError, match=r"apply to cifar10-dirichlet, cifar100-dirichlet, "
                                        r"fashion-mnist and medmnist, and to cifar10c, "
                                        r"digits-offline, imagefolder, npz-domains and "
                                        r"office-caltech10 with --partitions 2 or more$"):
        DataOptions(partition="shards").refuse_partition("x", "has one client")


def test_listed():
    assert [listed(n) for n in ([], ["a"], ["a", "b"], ["a", "b", "c"])] == [
        "none", "a", "a and b", "a, b and c"]
