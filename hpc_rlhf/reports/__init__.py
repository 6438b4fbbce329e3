"""Reports of finished or running runs, read from their folders alone: charts (PNG), a self-contained
report.html and summary.md (`hpc-rlhf report`, docs/report.md)."""
from .report import Report, write_report
from .runs import ReportError, Run, load_run

__all__ = ["Report", "ReportError", "Run", "load_run", "write_report"]
