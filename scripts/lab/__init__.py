"""The lab: what the experiments in scripts/ and the tests share and the package does not offer its users. The
GPU acceptance run of one_kernel's kernel (:mod:`lab.acceptance`), joining a mesh that spans several JAX processes
(:mod:`lab.multiprocess`, for scripts/run_multiprocess.py), the tail's building blocks one at a time
(:mod:`lab.blocks`) and random tail inputs with their float64 reference (:mod:`lab.accuracy`). A script run as
``python scripts/NAME.py`` imports it as ``lab`` (scripts/ is its sys.path[0]); the tests find it through
pytest's ``pythonpath`` (pyproject.toml). Its modules build on the package's and the command-line harness's
(:mod:`k3_tail.cli.harness`); nothing in the package imports them."""
