"""Running a job: the training loop, train.py's command line, progress, metrics, plots, report."""
