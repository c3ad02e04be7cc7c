"""`fedvl perf`: one workload, every engine (bare loop, embedded, Flower, peers), one table."""
