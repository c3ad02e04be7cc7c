"""`fedvl perf`: one workload, every engine (bare loop, embedded, Flower, peers), one table.

Optional and outside the library: no fedvl module imports this package; the `fedvl perf`
command imports it when it runs. Its loops exist only to be measured against the round driver.
"""
