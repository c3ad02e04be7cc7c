"""From a run config to a finished run.

`assemble` builds what a run is made of (data, models, the method, the in-process engine) and is
what Flower and `fedvl.eval` import; `experiment` runs, resumes and dry-runs a configured run.
Nothing is imported here, so importing `fedvl.run.assemble` does not load the runner.
"""
