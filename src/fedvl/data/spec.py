"""What each benchmark supports, declared where it is registered and read by name elsewhere."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from fedvl.registry import BENCHMARKS, register_benchmark

if TYPE_CHECKING:
    from fedvl.data.sources import DataOptions

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class BenchmarkSpec:
    """What a benchmark supports; one registered without a spec gets these defaults.

    `client_names` are the names of its clients, known before any data is read; a benchmark
    that declares them builds any one client alone when asked (`DataOptions.only_client`),
    reading no other client's data, which is what a Flower node of it does.
    """

    needs_data_dir: bool = True
    # Clients each domain is split into when `--partitions` is unset; None: it has no domains
    # to split and refuses `--partitions`.
    partitions: int | None = None
    # When `--partition` (and `--alpha`, ...) split its clients' labels: always, only when its
    # domains are split into 2 or more clients each, or never.
    label_split: Literal["always", "split-domains", "never"] = "never"
    client_names: Callable[[DataOptions], list[str]] | None = None
    # How many clients it will have, found without loading the data (it may look at which
    # files exist); unset, `client_names` decides when declared.
    count_clients: Callable[[DataOptions], int] | None = None
    # Run options only some benchmarks read (`domains`, `dataset`, `num_clients`, `severity`,
    # `corruptions`): config.yaml records them only for a benchmark that reads them.
    reads: frozenset[str] = frozenset()

    def num_clients(self, opts: DataOptions) -> int | None:
        """The number of clients `opts` gives, when known without loading data (else None)."""
        if self.count_clients is not None:
            return self.count_clients(opts)
        if self.client_names is not None:
            return len(self.client_names(opts))
        return None


DEFAULT_SPEC = BenchmarkSpec()


def declare_benchmark(name: str, spec: BenchmarkSpec) -> Callable[[F], F]:
    """Decorator registering a benchmark factory under `name` with what it supports."""

    def deco(factory: F) -> F:
        factory.spec = spec  # type: ignore[attr-defined]
        return register_benchmark(name)(factory)

    return deco


def declared_spec(name: str) -> BenchmarkSpec | None:
    """The spec benchmark `name` was registered with; None when it declared none."""
    spec = getattr(BENCHMARKS.get(name), "spec", None)
    return spec if isinstance(spec, BenchmarkSpec) else None


def spec_of(name: str) -> BenchmarkSpec:
    """What the registered benchmark `name` supports (KeyError naming the registered ones)."""
    return declared_spec(name) or DEFAULT_SPEC


def benchmarks_where(test: Callable[[BenchmarkSpec], bool]) -> list[str]:
    """The registered benchmark names, sorted, whose spec passes `test`."""
    return [n for n in BENCHMARKS.names() if test(spec_of(n))]


def listed(names: Iterable[str]) -> str:
    """Names as running text: 'a', 'a and b', 'a, b and c' ('none' when empty)."""
    items = list(names)
    if len(items) < 2:
        return items[0] if items else "none"
    return f"{', '.join(items[:-1])} and {items[-1]}"
