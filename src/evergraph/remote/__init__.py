"""Converge hosts over SSH with nothing installed on them but Python (issue 26)."""
