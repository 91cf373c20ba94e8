"""The embedded default for `mhar demo`: a small text (corpus.txt) and the pipeline that uses it."""
