"""Retention: pure policies, the per-job plan, the evictor that applies it, and pins."""
