"""Retention: the pure policies and the per-job plan of what each tier keeps."""
