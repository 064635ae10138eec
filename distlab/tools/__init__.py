"""Tools for people, on top of training: ``verify`` (every strategy against one process),
``faults`` (fault drills), ``report`` (HTML pages of runs and benchmarks), ``plots`` (the styles
every plot shares), ``demos`` (runnable explanations), ``doctor`` (what this machine can run),
``flags`` (where library field names meet command-line flags)."""
