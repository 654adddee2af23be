"""Reporters render reports; they compute nothing. Human text and --json come from the same object."""
