"""The application: the run config, run directory, releases, checkpoints, plots,
the trainer and the command line. It builds on the library layers below it and
nothing below imports it. Its public names are re-exported by ``dpmp``."""
