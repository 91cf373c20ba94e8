"""Nothing here is part of this repository's own test run: `mhar_tester.py` runs only inside the
scratch copy of transformers' test suite that `run_suite.py` builds (see README.md)."""

collect_ignore_glob = ["*"]
